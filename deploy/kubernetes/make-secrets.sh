#!/bin/sh
# The Secrets the manifests mount, made from the file `learnmesh compose-secrets` writes
# (every key of the mesh, generated; nothing in this repository works as a key):
#
#   learnmesh compose-secrets --out k8s-secrets.env
#   sh deploy/kubernetes/make-secrets.sh k8s-secrets.env | kubectl apply -n learnmesh -f -
#   rm k8s-secrets.env     # or keep it, 0600, wherever you keep secrets
#
# Each role gets only what it uses: the gateway the API and admin keys and the key sealing
# requestState (one for every replica); workers the delta
# ring (AES keys, verify keys); the trainer the ring and the signing key; each role its own
# CURVE secret key and its peers' public keys; everyone the Redis password. Values travel
# through 0600 files, never through kubectl's command line.
set -eu
[ $# -eq 1 ] || { echo "usage: $0 SECRETS_ENV_FILE (from learnmesh compose-secrets)" >&2; exit 2; }
case "$1" in */*) env_file=$1 ;; *) env_file=./$1 ;; esac
set -a
. "$env_file"
set +a
umask 077
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

put() {  # put FILE VALUE: one secret value, as a file kubectl reads
  printf '%s' "$2" > "$dir/$1"
}
put redis_password "$LEARNMESH_REDIS_PASSWORD"
put api_keys "$LEARNMESH_API_KEYS"
put admin_key "$LEARNMESH_ADMIN_KEY"
put request_state_keys "$LEARNMESH_REQUEST_STATE_KEYS"
put delta.key "$LEARNMESH_DELTA_KEY_RING"
put delta-sign.key "$LEARNMESH_DELTA_SIGN_KEY"
for role in gateway worker trainer; do
  upper=$(echo "$role" | tr a-z A-Z)
  eval "put $role.key_secret \"\$LEARNMESH_ZMQ_${upper}_SECRET\""
  eval "put $role.key \"\$LEARNMESH_ZMQ_${upper}_PUBLIC\""
done

secret() {  # secret NAME FILE...: one Secret manifest holding those files
  name=$1
  shift
  set --
  for f in $files; do set -- "$@" "--from-file=$f=$dir/$f"; done
  kubectl create secret generic "$name" --dry-run=client -o yaml "$@"
  echo "---"
}
files="redis_password"; secret learnmesh-redis
files="redis_password api_keys admin_key request_state_keys gateway.key_secret worker.key trainer.key"; secret learnmesh-gateway
files="redis_password delta.key worker.key_secret gateway.key trainer.key"; secret learnmesh-worker
files="redis_password delta.key delta-sign.key trainer.key_secret gateway.key worker.key"; secret learnmesh-trainer
