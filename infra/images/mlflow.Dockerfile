# The MLflow tracking server of infra/compose.yaml and infra/k8s: the official image plus the
# drivers its backend (Postgres) and artifact store (S3) need. Build from the repo root:
#   docker build -f infra/images/mlflow.Dockerfile -t tuneloop-mlflow:3.17.2 .
FROM ghcr.io/mlflow/mlflow:v3.17.2
RUN pip install --no-cache-dir psycopg2-binary==2.9.13 boto3==1.44.5
