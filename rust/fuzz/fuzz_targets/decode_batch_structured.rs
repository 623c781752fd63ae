//! Inputs that start like a real batch (`[ts, [event...], rank]` with a map event whose
//! keys are the field names vLLM sends), so the fuzzer reaches the field decoders
//! quickly instead of spending its time on the batch header.
//!
//!     cd rust/fuzz && cargo +nightly fuzz run decode_batch_structured -- -max_total_time=60
#![no_main]

use libfuzzer_sys::fuzz_target;
use quillcache_core::events::decode_batch;

const KEYS: [&str; 12] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "cache_salt",
    "session_id",
];

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    // [ts=0.0, [ {n keys: key_i -> fuzzer bytes} ], 0]
    let mut buf = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
    let n = (first & 0x0f) as usize;
    buf.push(0x80 | n as u8);
    let mut chunks = rest.split(|&b| b == 0xfe);
    for i in 0..n {
        let key = KEYS[(first as usize >> 4).wrapping_add(i) % KEYS.len()];
        buf.push(0xa0 | key.len() as u8);
        buf.extend_from_slice(key.as_bytes());
        buf.extend_from_slice(chunks.next().unwrap_or(&[0xc0]));
    }
    buf.push(0x00);
    let _ = decode_batch(&buf);
});
