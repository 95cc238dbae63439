# Certificates and password hashes for the compose deployments, sourced by
# scripts/cluster.sh and scripts/regions.sh. Both keep their CA and what it
# issues in "$secrets" (set by the sourcing script).

# A new CA in "$secrets": new_ca SUBJECT_CN.
new_ca() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$secrets/ca-key.pem" -out "$secrets/ca.pem" -days 825 -subj "/CN=$1" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

# One certificate from the CA: issue NAME EXTENDED_KEY_USAGE [SUBJECT_ALT_NAMES].
issue() {
  local name=$1 usage=$2 sans=${3:-}
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$secrets/$name-key.pem" -out "$secrets/$name.csr" -subj "/CN=adspend $name" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -z "$sans" ] || echo "subjectAltName=$sans"
  } >"$secrets/$name.ext"
  openssl x509 -req -in "$secrets/$name.csr" -CA "$secrets/ca.pem" -CAkey "$secrets/ca-key.pem" \
    -CAcreateserial -out "$secrets/$name.pem" -days 825 -extfile "$secrets/$name.ext" 2>/dev/null
  rm -f "$secrets/$name.csr" "$secrets/$name.ext"
}

# The bcrypt hash (cost 11) of the password on stdin, as nats-server takes it:
# bcrypt_hash PYTHON.
bcrypt_hash() {
  "$1" -c 'import sys, bcrypt; print(bcrypt.hashpw(sys.stdin.buffer.read(), bcrypt.gensalt(11)).decode())'
}
