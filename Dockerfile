# One image for the gateway and the reference worker; the command picks which one runs.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY worker ./worker
COPY infra ./infra
COPY loadtest ./loadtest
RUN pip install --no-cache-dir .
EXPOSE 8000
CMD ["python", "-m", "gateway", "--host", "0.0.0.0"]
