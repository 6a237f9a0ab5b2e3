"""Keeps kvaffined's endpoint file equal to the ready pods behind a headless Service.

kvaffined's `--discover HOST:PORT` names one replica, and that HOST:PORT is also the value
the gateway pins to, which Envoy's override_host compares with the pool's resolved
addresses (pod IP and port). So the daemon must be given pod IPs, which change as pods
come and go. This loop resolves the Service every few seconds, as Envoy's STRICT_DNS pool
does, and rewrites the file (atomically) when the set changes; kvaffined re-reads it
within a second, starts following new replicas and purges departed ones.

KVAFFINE_REPLICAS_SERVICE  the headless Service (default: vllm)
KVAFFINE_REPLICAS_PORT     the replicas' HTTP port (default: 8000)
KVAFFINE_ENDPOINTS_FILE    the file kvaffined reads with --config
KVAFFINE_RESOLVE_INTERVAL  seconds between resolutions (default: 5)
KVAFFINE_DISCOVERY         `kv_event_sources` (default): list the replicas under
                           "discover", and kvaffined asks each one's GET /kv_event_sources
                           (vLLM >= 0.31; one stream per data-parallel rank).
                           `ports`: list them under "endpoints" with the event ports below,
                           for older vLLM.
KVAFFINE_EVENTS_PORT       with `ports`: the PUB port of --kv-events-config (default: 5557)
KVAFFINE_REPLAY_PORT       with `ports`: the replay port, or empty for none (default: 5558)

`--once` resolves, writes and exits.
"""

import ipaddress
import json
import os
import socket
import sys
import time

SERVICE = os.environ.get("KVAFFINE_REPLICAS_SERVICE", "vllm")
PORT = int(os.environ.get("KVAFFINE_REPLICAS_PORT", "8000"))
OUT = os.environ.get("KVAFFINE_ENDPOINTS_FILE", "/run/kvaffine/endpoints/endpoints.json")
INTERVAL = float(os.environ.get("KVAFFINE_RESOLVE_INTERVAL", "5"))
MODE = os.environ.get("KVAFFINE_DISCOVERY", "kv_event_sources")
EVENTS_PORT = int(os.environ.get("KVAFFINE_EVENTS_PORT", "5557"))
REPLAY_PORT = os.environ.get("KVAFFINE_REPLAY_PORT", "5558")

# Answers meaning "no such name": a headless Service with no ready pod has no records.
NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def resolve():
    """The Service's addresses, IPv4 if there are any (Envoy's V4_PREFERRED), sorted."""
    try:
        infos = socket.getaddrinfo(SERVICE, PORT, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in NO_RECORDS:
            return []
        raise
    found = {info[4][0] for info in infos}
    v4 = sorted((a for a in found if ":" not in a), key=ipaddress.ip_address)
    v6 = sorted((a for a in found if ":" in a), key=ipaddress.ip_address)
    return v4 or v6


def document(addresses):
    """kvaffined's --config file for these replica addresses."""
    def hostport(address, port):
        return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"

    if MODE == "kv_event_sources":
        return {"discover": [hostport(a, PORT) for a in addresses]}
    if MODE == "ports":
        endpoints = []
        for address in addresses:
            spec = {
                "endpoint": hostport(address, PORT),
                "events": "tcp://" + hostport(address, EVENTS_PORT),
            }
            if REPLAY_PORT:
                spec["replay"] = "tcp://" + hostport(address, int(REPLAY_PORT))
            endpoints.append(spec)
        return {"endpoints": endpoints}
    raise SystemExit(f"KVAFFINE_DISCOVERY must be kv_event_sources or ports, not {MODE!r}")


def write(doc):
    """Replaces the file in one rename, so kvaffined never reads half of it."""
    tmp = f"{OUT}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, OUT)


def main():
    once = "--once" in sys.argv[1:]
    last = None
    while True:
        try:
            doc = document(resolve())
        except OSError as err:
            # A failing resolver keeps the current list: dropping every replica on a DNS
            # hiccup would purge the whole index.
            print(f"cannot resolve {SERVICE}: {err}; keeping the current list", file=sys.stderr, flush=True)
            doc = last
        if doc is not None and doc != last:
            write(doc)
            print(f"{OUT}: {json.dumps(doc)}", flush=True)
            last = doc
        if once:
            return 0 if last is not None else 1
        time.sleep(INTERVAL)


if __name__ == "__main__":
    sys.exit(main())
