"""Probe: per step of a bros run, why new RT requests did not start (parked RT admission
control, BE floor / owed reserve, or no memory), and the memory split, in a time window."""
import argparse, json, sys
from collections import Counter

def main(argv):
    from loadgen.cli import add_run_args
    from loadgen.provenance import stamp
    from engine.scheduling import bros_step as bs
    from engine.scheduling.request import RequestClass
    ap = argparse.ArgumentParser()
    add_run_args(ap, target_default="sim", workload_default="rt-be")
    ap.add_argument("--window", default="0,1e9")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lo, hi = map(float, args.window.split(","))
    rows, totals = [], Counter()
    orig_run = bs.BROSStep.run
    orig_held = bs.BROSStep._held_for_be

    def held_for_be(self, r):
        out = orig_held(self, r)
        if out:
            self.__dict__.setdefault("_probe_held", []).append(r)
        return out

    bs.BROSStep._held_for_be = held_for_be

    def run(self):
        batch = orig_run(self)
        now = self.state.now
        d = self.decision
        kv = self.kv
        rt = RequestClass.RT
        new_rt = [r for r in self.state.waiting if r.req_class is rt and not kv.holds(r)]
        started = [r for r in d.rt_scheduled if r in self.cached]
        waiting_new = [r for r in new_rt if r not in d.rt_scheduled]
        parked = self._parked_rt()
        reserve = max(self.owed_blocks, self.floor.deficit)
        held_be = getattr(self, "_probe_held", [])
        reason = "none"
        if waiting_new:
            if parked:
                reason = "parked_rt"
            elif held_be:
                reason = "floor" if self.floor.deficit >= self.owed_blocks else "owed"
            elif any(r in d.skipped for r in waiting_new):
                reason = "no_memory"
            else:
                reason = "time_or_cap"
        totals[reason] += len(waiting_new)
        if lo <= now <= hi:
            held = lambda c: sum(kv.device_blocks(x) for x in self.state.running if x.req_class is c)
            rows.append(dict(t=round(now, 3), new_rt_waiting=len(waiting_new), started=len(started), reason=reason,
                             free=kv.pool.num_free, rt_blocks=held(rt), be_blocks=held(RequestClass.BE),
                             rt_on_host=sum(1 for x in self.state.running if x.req_class is rt and not kv.is_resident(x)),
                             floor_deficit=self.floor.deficit, owed_blocks=self.owed_blocks,
                             protected=len(self.floor.protected), budget_ms=round(d.budget_s * 1e3, 1) if d.budget_s < 1e9 else None,
                             est_ms=round(d.estimate_s * 1e3, 1)))
        return batch

    bs.BROSStep.run = run
    from loadgen.sim.bros_trace import trace
    args.policies, args.steps, args.windows = "bros", False, None
    prov = stamp().as_dict()
    out = trace(args, "bros")
    doc = {"config": {k: v for k, v in vars(args).items()}, "request_steps_waiting_by_reason": dict(totals),
           "window": rows, "rt_latency_parts": out.get("rt_latency_parts"), "provenance": prov}
    print(json.dumps(doc["request_steps_waiting_by_reason"]), json.dumps(out.get("rt_latency_parts")))
    if args.json:
        open(args.json, "w").write(json.dumps(doc, indent=1))

if __name__ == "__main__":
    main(sys.argv[1:])
