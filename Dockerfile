# One image for every deepmesh service; docker-compose.yml picks the service by its command.
FROM python:3.11-slim

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY pyproject.toml README.md ./
COPY engine engine
COPY common common
COPY tokenizer_svc tokenizer_svc
COPY prefill_svc prefill_svc
COPY decode_svc decode_svc
COPY cache_svc cache_svc
COPY gateway gateway
COPY deepmesh deepmesh
RUN pip install .
# claim checks: large message values, in a volume every service mounts (common/claims.py)
RUN mkdir -p /claims && chown nobody /claims

USER nobody
ENTRYPOINT []
