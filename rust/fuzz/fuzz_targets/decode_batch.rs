//! Arbitrary bytes into the event decoder: it must return Ok or Err, never panic,
//! never allocate more than the input justifies (libFuzzer's -rss_limit_mb and
//! -malloc_limit_mb catch that).
//!
//!     cd rust/fuzz && cargo +nightly fuzz run decode_batch -- -max_total_time=60
#![no_main]

use libfuzzer_sys::fuzz_target;
use quillcache_core::events::decode_batch;

fuzz_target!(|data: &[u8]| {
    let _ = decode_batch(data);
});
