#!/bin/sh
# HTTP on 8080 and UDP on 9000, each answering with this pod's name (socat runs this same
# script once per connection or datagram, with "http" or "udp").
case "${1:-}" in
  http) read -r _ || true; printf 'HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhttp %s\n' "$(hostname)" ;;
  udp) read -r _ || true; echo "udp $(hostname)" ;;
  *)
    socat -T5 UDP-RECVFROM:9000,fork,reuseaddr EXEC:"$0 udp" &
    exec socat -T5 TCP-LISTEN:8080,fork,reuseaddr EXEC:"$0 http" ;;
esac
