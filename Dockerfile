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
# Not root (docs/DESIGN.md, "Job → controller"): a controller in this image cannot switch users, so
# its jobs run as `iris` too (it warns at start-up). The state and key volumes start out owned by
# it (a named volume copies the image's ownership). A production peer runs its controller as root
# with `run_as`, or a container-per-job backend.
RUN useradd --system --uid 10001 --user-group --home-dir /app --no-create-home --shell /usr/sbin/nologin iris \
    && mkdir -p /var/lib/iris /keys /app/.data \
    && chown iris:iris /var/lib/iris /keys /app/.data \
    && chmod 0700 /var/lib/iris /keys
USER iris
ENV IRIS_CONFIG=/app/config/compose.toml
ENTRYPOINT ["iris"]
