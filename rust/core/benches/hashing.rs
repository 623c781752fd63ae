//! Criterion benches of the hashing and event-decoding hot paths.
//!
//!     cargo bench -p quillcache-core --bench hashing
//!
//! Throughput is reported in tokens/s (content key, vLLM parity) and bytes/s (decode).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use quillcache_core::content_key::chain_keys;
use quillcache_core::events::decode_batch;
use quillcache_core::vllm_hash::{block_hashes, none_hash, DEFAULT_SEED};

/// Deterministic pseudo-random token ids in a 152k vocabulary.
fn tokens(n: usize) -> Vec<u32> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 152_064) as u32
        })
        .collect()
}

fn content_key(c: &mut Criterion) {
    let toks = tokens(1 << 20);
    let mut group = c.benchmark_group("content_key_chain");
    group.throughput(Throughput::Elements(toks.len() as u64));
    for block_size in [16usize, 64, 128, 512] {
        group.bench_with_input(
            BenchmarkId::from_parameter(block_size),
            &block_size,
            |b, &bs| {
                let mut out = Vec::with_capacity(toks.len() / bs);
                b.iter(|| {
                    out.clear();
                    chain_keys(black_box(7), black_box(&toks), bs, &mut out);
                    black_box(out.len())
                })
            },
        );
    }
    group.finish();
}

fn vllm_parity(c: &mut Criterion) {
    let toks = tokens(1 << 16);
    let root = none_hash(DEFAULT_SEED);
    let mut group = c.benchmark_group("vllm_sha256_cbor");
    group.throughput(Throughput::Elements(toks.len() as u64));
    group.bench_function("block_size_16", |b| {
        b.iter(|| black_box(block_hashes(&root, black_box(&toks), 16, &[])).len())
    });
    group.finish();
}

/// A vLLM-shaped batch: `events` BlockStored events of 4 blocks × 16 tokens each,
/// map form, uint64 hashes, as vLLM 0.34 writes it.
fn stored_batch(events: usize) -> Vec<u8> {
    use rmp::encode::*;
    let toks = tokens(64);
    let mut out = Vec::new();
    write_array_len(&mut out, 3).unwrap();
    write_f64(&mut out, 1.7e9).unwrap();
    write_array_len(&mut out, events as u32).unwrap();
    for e in 0..events as u64 {
        write_map_len(&mut out, 10).unwrap();
        let key = |out: &mut Vec<u8>, k: &str| write_str(out, k).unwrap();
        key(&mut out, "type");
        key(&mut out, "BlockStored");
        key(&mut out, "block_hashes");
        write_array_len(&mut out, 4).unwrap();
        for i in 0..4 {
            write_uint(&mut out, (e * 4 + i).wrapping_mul(0x9e37_79b9_7f4a_7c15)).unwrap();
        }
        key(&mut out, "parent_block_hash");
        write_uint(&mut out, e.wrapping_mul(31)).unwrap();
        key(&mut out, "token_ids");
        write_array_len(&mut out, toks.len() as u32).unwrap();
        for &t in &toks {
            write_uint(&mut out, t as u64).unwrap();
        }
        key(&mut out, "block_size");
        write_uint(&mut out, 16).unwrap();
        key(&mut out, "lora_id");
        write_nil(&mut out).unwrap();
        key(&mut out, "medium");
        key(&mut out, "GPU");
        key(&mut out, "lora_name");
        write_nil(&mut out).unwrap();
        key(&mut out, "extra_keys");
        write_array_len(&mut out, 4).unwrap();
        (0..4).for_each(|_| write_nil(&mut out).unwrap());
        key(&mut out, "group_idx");
        write_uint(&mut out, 0).unwrap();
    }
    write_uint(&mut out, 0).unwrap();
    out
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_batch");
    for events in [1usize, 64, 1024] {
        let payload = stored_batch(events);
        assert_eq!(decode_batch(&payload).unwrap().events.len(), events);
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("stored_events", events),
            &payload,
            |b, p| b.iter(|| black_box(decode_batch(black_box(p)).unwrap()).events.len()),
        );
    }
    group.finish();
}

criterion_group!(benches, content_key, vllm_parity, decode);
criterion_main!(benches);
