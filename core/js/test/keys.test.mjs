// The packed kvaffine-keys against vLLM's own golden vectors (../shared/vectors), loaded
// both ways a user loads it: a synchronous require() (Node) and the ES module of the
// browser build. `cargo xtask npm --test` unpacks the tarball beside this file and runs it.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";

const require = createRequire(import.meta.url);
const vectorsPath = process.env.KVAFFINE_VECTORS;
assert.ok(vectorsPath, "KVAFFINE_VECTORS names ../shared/vectors/block_hashes.json");
const vectors = JSON.parse(readFileSync(vectorsPath, "utf8"));

const compat = { "0.33.0": "0.31", "0.30.0": "0.30", "0.28.0": "0.30" };

// Every reproducible case: the CBOR algorithms (pickle ones are Python-only by design).
function cases() {
  const out = [];
  for (const version of vectors.versions) {
    for (const c of version.cases) {
      if (c.skipped || !c.algo.endsWith("_cbor")) continue;
      const options = { blockSize: c.block_size, hashAlgo: c.algo, vllmCompat: compat[version.vllm_version] };
      if (c.pythonhashseed !== null) options.hashSeed = c.pythonhashseed;
      if (c.cache_salt !== null) options.cacheSalt = c.cache_salt;
      if (c.lora) {
        options.loraName = c.lora.lora_name;
        options.loraPath = c.lora.lora_path;
      }
      const want = c.blocks.map((b) => ({
        full: b.hash_hex,
        // JSON numbers lose u64 precision in JS: the hex form is exact.
        event: BigInt("0x" + b.event_block_hash_int_hex.replace(/^0x/, "")).toString(),
      }));
      out.push({ id: c.id, tokens: vectors.sequences[c.sequence], options, want });
    }
  }
  return out;
}

function checkAll(blockKeys) {
  const all = cases();
  assert.ok(all.length > 100, `only ${all.length} cases`);
  let blocks = 0;
  for (const c of all) {
    const got = blockKeys(c.tokens, c.options);
    assert.deepEqual(got, { hashes: c.want }, c.id);
    assert.deepEqual(blockKeys(Uint32Array.from(c.tokens), c.options), got, c.id);
    blocks += c.want.length;
  }
  assert.ok(blocks > 500, `only ${blocks} blocks`);
}

test("require() loads synchronously and keys every vector as vLLM does", () => {
  const { blockKeys } = require("kvaffine-keys");
  checkAll(blockKeys);
});

test("the browser build is an ES module that keys the same", async () => {
  const web = await import("kvaffine-keys/web");
  const wasm = readFileSync(require.resolve("kvaffine-keys/web/kvaffine_keys_bg.wasm"));
  web.initSync({ module: wasm });
  checkAll(web.blockKeys);
});

test("bad input throws an Error with core's one-line message", () => {
  const { blockKeys } = require("kvaffine-keys");
  const cases = [
    [[1, 2], {}, /blockSize/],
    [[1, -1], { blockSize: 4 }, /index 1 is negative/],
    [[1, 2.5], { blockSize: 4 }, /index 1 is not an integer/],
    [[2 ** 32], { blockSize: 4 }, /exceeds 4294967295/],
    [["7"], { blockSize: 4 }, /index 0 is not an integer/],
    ["1,2", { blockSize: 4 }, /array of token ids/],
    [[1], { blockSize: 4, cacheSalt: "a/b" }, /'\/'/],
    [[1], { blockSize: 4, hashAlgo: "xxhash_cbor" }, /needs a hash seed/],
    [[1], { blockSize: 4, loraName: "x" }, /loraPath/],
    [[1], { blockSize: 4, blocksize: 4 }, /unknown option "blocksize"/],
  ];
  for (const [tokens, options, why] of cases) {
    assert.throws(
      () => blockKeys(tokens, options),
      (err) => err instanceof Error && why.test(err.message) && !err.message.includes("\n"),
      `${JSON.stringify(tokens)} ${JSON.stringify(options)}`,
    );
  }
});
