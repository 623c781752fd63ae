//! Inputs shaped like SGLang's batches (`docs/kv-events.md`, "SGLang"): the tagged
//! arrays of SGLang <= 0.5.19 (`["BlockStored", hashes, parent, tokens, block_size,
//! lora_id, medium, {metadata}]`, `["BlockRemoved", hashes, medium]`) and the tagged
//! maps of >= 0.5.20 with its keys (`cache_salt`, `session_id`, `lora_name`), with
//! fuzzer bytes in every field and metadata value, so the fuzzer reaches the SGLang
//! paths (the metadata map, signed hashes) at once.
//!
//!     cd rust/fuzz && cargo +nightly fuzz run decode_batch_sglang -- -max_total_time=60
#![no_main]

use libfuzzer_sys::fuzz_target;
use quillcache_core::events::decode_batch;

const MAP_KEYS: [&str; 10] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "session_id",
    "lora_name",
];
const METADATA_KEYS: [&str; 2] = ["cache_salt", "future"];

fn fixstr(buf: &mut Vec<u8>, s: &str) {
    buf.push(0xa0 | s.len() as u8);
    buf.extend_from_slice(s.as_bytes());
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let mut chunks = rest.split(|&b| b == 0xfe);
    let mut next = |default: &'static [u8]| chunks.next().unwrap_or(default).to_vec();
    // [ts=0.0, [event], rank=0]
    let mut buf = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
    let n = (first & 0x07) as usize;
    match first >> 6 {
        0 | 1 => {
            // array BlockStored: the 5 required fields, medium, then metadata (n keys)
            let with_metadata = first & 0x08 != 0;
            buf.push(0x90 | (7 + with_metadata as u8));
            fixstr(&mut buf, "BlockStored");
            for default in [
                &[0x91, 0xff][..],
                &[0xc0],
                &[0x91, 0x01],
                &[0x01],
                &[0xc0],
                &[0xc0],
            ] {
                buf.extend(next(default));
            }
            if with_metadata {
                buf.push(0x80 | n as u8);
                for i in 0..n {
                    fixstr(
                        &mut buf,
                        METADATA_KEYS[(first as usize >> 4).wrapping_add(i) % 2],
                    );
                    buf.extend(next(&[0xc0]));
                }
            }
        }
        2 => {
            // array BlockRemoved: hashes, medium
            buf.push(0x93);
            fixstr(&mut buf, "BlockRemoved");
            buf.extend(next(&[0x91, 0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]));
            buf.extend(next(&[0xc0]));
        }
        _ => {
            // map event with SGLang's keys
            buf.push(0x80 | (n + 1) as u8);
            fixstr(&mut buf, "type");
            fixstr(
                &mut buf,
                if first & 0x08 != 0 {
                    "BlockStored"
                } else {
                    "BlockRemoved"
                },
            );
            for i in 0..n {
                fixstr(&mut buf, MAP_KEYS[1 + (first as usize).wrapping_add(i) % 9]);
                buf.extend(next(&[0xc0]));
            }
        }
    }
    buf.push(0x00);
    let _ = decode_batch(&buf);
});
