#!/usr/bin/env bash
# Make a mesh CA and one certificate per node for meshpipe TLS.
#
#   bash deploy/make-certs.sh OUT_DIR NODE [NODE ...]
#
# Writes OUT_DIR/ca.pem + ca-key.pem (the CA; keep ca-key.pem off the nodes) and, for each
# NODE, OUT_DIR/NODE.pem + NODE-key.pem. Every node certificate carries subjectAltName
# DNS:meshpipe, the fixed name meshpipe checks peers against (nodes are dialled by IP), plus
# DNS:NODE. An existing CA in OUT_DIR is reused, so nodes can be added later.
# Each node gets ca.pem, its own NODE.pem and NODE-key.pem:
#   mesh stage ... --tls-cert NODE.pem --tls-key NODE-key.pem --tls-ca ca.pem
# DAYS (default 825) sets the validity of new certificates.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 OUT_DIR NODE [NODE ...]" >&2
    exit 2
fi
out=$1
shift
days=${DAYS:-825}
for node in "$@"; do
    case $node in
        "" | .* | *[!A-Za-z0-9._-]* | ca | ca-key)
            echo "bad node name: '$node' (letters, digits, . _ -; not 'ca')" >&2; exit 2 ;;
    esac
done

umask 077
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

serial() { echo "0x$(openssl rand -hex 16)"; }

if [ ! -f "$out/ca.pem" ] || [ ! -f "$out/ca-key.pem" ]; then
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$out/ca-key.pem" -out "$out/ca.pem" -days "$days" -set_serial "$(serial)" \
        -subj "/CN=meshpipe mesh CA" \
        -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -addext "subjectKeyIdentifier=hash" 2>/dev/null
    chmod 644 "$out/ca.pem"
    echo "wrote $out/ca.pem (CA key: $out/ca-key.pem)"
fi

for node in "$@"; do
    cat > "$tmp/ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:meshpipe,DNS:$node
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid:always
EXT
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$out/$node-key.pem" -out "$tmp/csr" -subj "/CN=$node" 2>/dev/null
    openssl x509 -req -in "$tmp/csr" -CA "$out/ca.pem" -CAkey "$out/ca-key.pem" \
        -set_serial "$(serial)" -days "$days" -extfile "$tmp/ext" -out "$out/$node.pem" 2>/dev/null
    chmod 644 "$out/$node.pem"
    echo "wrote $out/$node.pem and $out/$node-key.pem"
done
