"""engine.loader's tokenizers: the default GGUF's converted tokenizer against transformers' own
conversion (and its cache), an HF directory's own tokenizer files."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from engine.loader import ModelLoadError, ModelSource, load_tokenizer, resolve_model
from tests.conftest import GGUF_NAME
from tests.engine.tiny_hf_models import save_tiny

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def default_src() -> ModelSource:
    return resolve_model("default")


@pytest.fixture(scope="module")
def reference(default_src: ModelSource, smollm2_dir, hf_default_tokenizer) -> transformers.PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer conversion (of the same file, once per session)."""
    assert default_src.path.resolve() == (smollm2_dir / GGUF_NAME).resolve()
    return hf_default_tokenizer


def test_gguf_tokenizer_matches_transformers_and_is_cached(
    default_src: ModelSource, reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))

    first = load_tokenizer(default_src)
    cached_dirs = list((tmp_path / "tokenizers").iterdir())
    assert len(cached_dirs) == 1 and (cached_dirs[0] / "tokenizer.json").is_file()

    # The second load must come from the cache, not from a GGUF conversion.
    calls: list[dict] = []
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        calls.append({"args": args, **kwargs})
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    second = load_tokenizer(default_src)
    # Read from the cache, not converted: shown by the one call and its arguments (a timing
    # comparison with the conversion, here before, is what a loaded machine can reverse).
    assert len(calls) == 1 and "gguf_file" not in calls[0]
    assert Path(calls[0]["args"][0]) == cached_dirs[0]

    chat = [{"role": "user", "content": "hi"}]
    expected_chat = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert expected_chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for tok in (first, second):
        assert tok(PROMPT).input_ids == reference(PROMPT).input_ids
        assert tok.chat_template == reference.chat_template
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == expected_chat
        assert (tok.bos_token, tok.eos_token) == (reference.bos_token, reference.eos_token)
        ids = tok(expected_chat).input_ids
        assert ids == reference(expected_chat).input_ids
        assert tok.decode(ids) == expected_chat


def test_cache_key_changes_with_file(tmp_path: Path) -> None:
    from engine.loader.tokenizer import tokenizer_cache_path

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    before = tokenizer_cache_path(f, tmp_path)
    f.write_bytes(b"xy")
    assert tokenizer_cache_path(f, tmp_path) != before
    assert before.parent == tmp_path / "tokenizers"


def test_hf_dir_tokenizer_missing_files_is_clear(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(resolve_model(str(tmp_path)))


def test_hf_dir_tokenizer(reference, tmp_path: Path) -> None:
    """An HF directory's own tokenizer files are used as they are (no cache involved)."""
    save_tiny("llama", tmp_path / "m")
    reference.save_pretrained(tmp_path / "m")
    tok = load_tokenizer(resolve_model(str(tmp_path / "m")))
    assert tok(PROMPT).input_ids == reference(PROMPT).input_ids
    assert tok.chat_template == reference.chat_template
