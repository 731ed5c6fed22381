# The project image: worker, controllers and CLI share it.
FROM python:3.11-slim
COPY --from=ghcr.io/astral-sh/uv:latest /uv /usr/local/bin/uv
WORKDIR /app
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy PATH="/app/.venv/bin:$PATH"
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project
COPY iris ./iris
COPY workflows ./workflows
COPY activities ./activities
COPY worker ./worker
COPY cli ./cli
COPY config ./config
RUN uv sync --frozen --no-dev
ENV IRIS_CONFIG=/app/config/compose.toml
ENTRYPOINT ["iris"]
