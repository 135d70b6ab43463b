# One image for every deepmesh service; docker-compose.yml picks the service by its command.
FROM python:3.11-slim

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HOME=/tmp TORCHINDUCTOR_CACHE_DIR=/inductor
# g++: Inductor compiles the decode step to C++ (engine/compiled_decode.py); without it, eager
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY engine engine
COPY common common
COPY tokenizer_svc tokenizer_svc
COPY encoder_svc encoder_svc
COPY prefill_svc prefill_svc
COPY decode_svc decode_svc
COPY cache_svc cache_svc
COPY gateway gateway
COPY deepmesh deepmesh
RUN pip install .
# claim checks: large message values, in a volume every service mounts (common/claims.py)
RUN mkdir -p /claims && chown nobody /claims
# the compiled decode graphs, in a volume: a restarted decode worker loads them instead of compiling
RUN mkdir -p /inductor && chown nobody /inductor

USER nobody
ENTRYPOINT []
