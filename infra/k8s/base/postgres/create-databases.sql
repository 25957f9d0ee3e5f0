-- Run once by the postgres image on an empty data directory (/docker-entrypoint-initdb.d),
-- as the POSTGRES_USER; POSTGRES_DB (mlflow) exists already. Shared by infra/compose.yaml.
CREATE DATABASE prefect;
CREATE DATABASE tuneloop;  -- API keys (gateway.key_store_url) and the request log (request_log.url)
