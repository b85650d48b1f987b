#!/usr/bin/env bash
# nginx as a reverse proxy with upstream keep-alive in front of the demo server
# (tests/demo/server.py), both children of this script, so that one process tree
# (this script's pid) holds the proxy's client sockets and the demo's GPU work.
#   nginx_demo.sh PORT DEMO_PORT CUDART
# With STACK_STAMPS set, the demo writes its truth log (its own stamps of each
# request) there.
# With STACK_TLS_CERT and STACK_TLS_KEY set, nginx terminates TLS (1.2 and 1.3,
# with a session cache and tickets, so that clients may resume).
# With STACK_GRPC_PYTHON set (a Python with grpcio), the backend is instead the
# gRPC service of grpc_stream.py, and nginx serves HTTP/2 in clear text
# (prior knowledge, as gRPC clients speak it) and passes each call on by
# grpc_pass, over HTTP/2 connections of its own.
set -euo pipefail
port=$1 demo_port=$2 cudart=$3
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d /tmp/ttft-nginx.XXXXXX)
trap 'wait; rm -rf "$dir"' EXIT
trap 'exit 143' TERM INT
listen_opts="" tls_conf=""
if [ -n "${STACK_TLS_CERT:-}" ]; then
    listen_opts=" ssl"
    tls_conf="ssl_certificate $STACK_TLS_CERT; ssl_certificate_key $STACK_TLS_KEY;
        ssl_protocols TLSv1.2 TLSv1.3; ssl_session_cache shared:TLS:1m;"
fi
pass="proxy_pass http://demo;
            # Upstream keep-alive needs HTTP/1.1 and no \"Connection: close\".
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            # Each token goes to the client as it comes.
            proxy_buffering off;"
if [ -n "${STACK_GRPC_PYTHON:-}" ]; then
    listen_opts=" http2"
    pass="grpc_pass grpc://demo;"
    STACK_CUDART=$cudart "$STACK_GRPC_PYTHON" "$here/grpc_stream.py" serve "$demo_port" &
else
    # A 1 GB model: 0.2 s of copies before the demo listens, not 24 GB's 2.5 s.
    python3 "$here/../demo/server.py" --port "$demo_port" --cudart "$cudart" --load-gb 1 \
        ${STACK_STAMPS:+--truth "$STACK_STAMPS"} >/dev/null &
fi
cat >"$dir/nginx.conf" <<CONF
worker_processes 1;
pid $dir/nginx.pid;
error_log stderr warn;
events { worker_connections 64; }
http {
    access_log off;
    client_body_temp_path $dir/body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
    upstream demo {
        server 127.0.0.1:$demo_port;
        keepalive 4;
    }
    server {
        listen 127.0.0.1:$port$listen_opts;
        $tls_conf
        location / {
            $pass
        }
    }
}
CONF
nginx -p "$dir" -c "$dir/nginx.conf" -e stderr -g 'daemon off;' &
wait
