"""The benchmarks' oracle on real vLLM: what each replica holds, rebuilt from the replica's
own KV events, decoded with vLLM's own classes (run with the venv's Python).

    python oracle.py --port P --block-size 32 --replica NAME=EVENTS_URL,REPLAY_URL ...

It knows nothing of kvaffine and computes no hash: a block is identified by its parent
block and its content (token ids and published extra keys, e.g. the cache salt), exactly
as the replica published it. Each replica's history is replayed from its replay socket,
then followed live; a sequence gap is filled from the replay socket again.

    GET  /ready   200 once every replica is replayed, with the blocks held, the gaps the
                  replay could not fill and the last seq applied, per replica
    POST /cached  {"token_ids": [...], "cache_salt": "s" | null}
                  -> {"cached_tokens": {"NAME": n, ...}}: the tokens each replica would
                  serve from its cache (whole blocks; vLLM always computes the last
                  prompt token)
"""

import argparse
import http.server
import json
import threading

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END_SEQ = 0xFFFFFFFFFFFFFFFF
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def frozen(value):
    """Published extra keys as a hashable value (msgpack arrays decode to lists)."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


class Replica:
    """One replica's blocks: the physical copies each KV-cache group holds of each hash, and
    which content (parent and tokens) each hash names.

    A hybrid-attention model (GPT-OSS, Gemma 3) publishes a group per attention type: a
    prompt is served the longest prefix its full-attention groups hold, cut back to the
    last point where each sliding-window group holds the ceil((window - 1) / block_size)
    blocks before it (or a shorter run from block 0), as vLLM 0.32's hybrid coordinator
    serves it. A window group's store lists only the blocks it keeps; their hashes are the
    full-attention group's for the same blocks.
    """

    def __init__(self, name, block_size):
        self.name = name
        self.block_size = block_size
        self.copies = {}  # group -> {hash: copies}
        self.windows = {}  # window group -> blocks needed before a hit point
        self.children = {}  # content -> hash
        self.ready = False
        self.unfilled_gaps = 0
        self.last_seq = -1

    def apply(self, payload):
        events = DECODER.decode(payload).events
        for event in events:
            # Window stores name blocks whose content only a full store says, possibly
            # later in the same batch: learn every full store's contents first.
            if isinstance(event, BlockStored) and self.full_store(event):
                self.learn(event)
        for event in events:
            if isinstance(event, BlockStored):
                self.stored(event)
            elif isinstance(event, BlockRemoved):
                held = self.copies.get(event.group_idx or 0, {})
                for block in event.block_hashes:
                    if held.get(block, 0) > 1:
                        held[block] -= 1
                    else:
                        held.pop(block, None)
            elif isinstance(event, AllBlocksCleared):
                self.copies.clear()

    def full_store(self, event):
        return len(event.token_ids) == len(event.block_hashes) * event.block_size

    def learn(self, event):
        parent = event.parent_block_hash
        extra = event.extra_keys or [None] * len(event.block_hashes)
        size = event.block_size
        for i, block in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            content = (parent, tokens, frozen(extra[i]) if i < len(extra) else None)
            self.children[content] = block
            parent = block

    def stored(self, event):
        group = event.group_idx or 0
        if event.kv_cache_spec_kind == "sliding_window":
            window = event.kv_cache_spec_sliding_window or 0
            self.windows[group] = -(-(window - 1) // event.block_size)
        held = self.copies.setdefault(group, {})
        for block in event.block_hashes:
            held[block] = held.get(block, 0) + 1

    def cached_tokens(self, token_ids, salt):
        size = self.block_size
        parent, chain = None, []
        servable = max(len(token_ids) - 1, 0) // size
        for i in range(servable):
            extra = (salt,) if (i == 0 and salt) else None
            content = (parent, tuple(token_ids[i * size : (i + 1) * size]), extra)
            block = self.children.get(content)
            if block is None:
                break
            chain.append(block)
            parent = block
        full = [g for g in self.copies if g not in self.windows] or [0]
        hit = 0
        while hit < len(chain) and all(self.copies.get(g, {}).get(chain[hit]) for g in full):
            hit += 1
        while self.windows:
            before = hit
            for group, needed in self.windows.items():
                held = self.copies.get(group, {})
                hit = next(
                    (end for end in range(hit, 0, -1)
                     if all(held.get(b) for b in chain[max(end - needed, 0):end])),
                    0,
                )
            if hit == before or hit == 0:
                break
        return hit * size


def follow(replica, events_url, replay_url, lock):
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_url)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay_url)

    def replay(start):
        """Applies every buffered batch from `start`; returns the last seq applied."""
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        last = start - 1
        while True:
            frames = dealer.recv_multipart()
            # [b"", topic, seq, payload] since 0.26, [b"", seq, payload] before.
            seq = int.from_bytes(frames[-2], "big")
            if seq == END_SEQ:
                return last
            if seq >= start:
                with lock:
                    replica.apply(frames[-1])
                    replica.last_seq = seq
                last = seq

    last = replay(0)
    with lock:
        replica.ready = True
    while True:
        _topic, seq_frame, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        if seq <= last:
            continue
        if seq > last + 1:
            filled = replay(last + 1)
            if filled < seq - 1:
                with lock:
                    replica.unfilled_gaps += 1
            if seq <= filled:
                last = filled
                continue
        with lock:
            replica.apply(payload)
            replica.last_seq = seq
        last = seq


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--replica", action="append", required=True)
    args = parser.parse_args()
    lock = threading.Lock()
    replicas = []
    for spec in args.replica:
        name, urls = spec.split("=", 1)
        events_url, replay_url = urls.split(",", 1)
        replica = Replica(name, args.block_size)
        replicas.append(replica)
        threading.Thread(
            target=follow, args=(replica, events_url, replay_url, lock), daemon=True
        ).start()

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path != "/ready":
                return self.reply(404, {"error": "not found"})
            with lock:
                ready = all(r.ready for r in replicas)
                body = {
                    r.name: {
                        "blocks": sum(len(held) for held in r.copies.values()),
                        "unfilled_gaps": r.unfilled_gaps,
                        "last_seq": r.last_seq,
                    }
                    for r in replicas
                }
            self.reply(200 if ready else 503, body)

        def do_POST(self):
            if self.path != "/cached":
                return self.reply(404, {"error": "not found"})
            length = int(self.headers.get("content-length", "0"))
            try:
                request = json.loads(self.rfile.read(length))
                tokens = [int(t) for t in request["token_ids"]]
                salt = request.get("cache_salt")
            except (ValueError, KeyError, TypeError) as e:
                return self.reply(400, {"error": f"bad request: {e}"})
            with lock:
                cached = {r.name: r.cached_tokens(tokens, salt) for r in replicas}
            self.reply(200, {"cached_tokens": cached})

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
