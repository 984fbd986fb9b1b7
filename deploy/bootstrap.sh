#!/bin/sh
# One-shot `migrate` service of docker-compose.yml: migrate the database to the Alembic head, then create the
# tokens the stack uses itself, once. Tokens are stored hashed, so the plain ones exist only in the
# bootstrap-secrets volume (mode 600): Prometheus scrapes with the viewer one, the demo trainer sends with the agent one.
set -eu
secrets=${ATTNCHECKER_BOOTSTRAP_DIR:-/run/attnchecker}  # the variable is for tests/dashboards/test_deploy.py
attnchecker-server migrate
umask 077
make_token() {  # role name file: `token create` prints the token once, on its last line
  if [ ! -s "$secrets/$3" ]; then
    attnchecker-server token create --role "$1" --name "$2" | tail -n 1 > "$secrets/$3.tmp"
    mv "$secrets/$3.tmp" "$secrets/$3"
  fi
}
make_token viewer prometheus prometheus-token
make_token agent demo-trainer agent-token
# Prometheus and the trainer run as other users: the tokens must be readable by them inside this private volume.
chmod 644 "$secrets/prometheus-token" "$secrets/agent-token"
