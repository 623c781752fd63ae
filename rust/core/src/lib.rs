//! QuillCache core: everything on the hot path that does not need Python.
//!
//! * [`namespace`] and [`content_key`]: identity and QuillCache's own chained block key.
//! * [`vllm_hash`]: byte-exact parity with vLLM's `sha256_cbor` block hashes.
//! * [`events`]: decoding of the engines' KV-event batches (every wire shape we know).
//! * [`index`]: the residency index (which source holds which block, in which medium).
//! * [`backends`]: the index over key-value stores (RocksDB, Holt) for the ART-vs-LSM study.
//! * [`persist`]: write-ahead log, snapshots, the crash-safe index (docs/persistence.md).
//! * [`speculative`]: the prefixes being computed on workers, until their events arrive.
//! * [`load_order`]: a fleet's rows in order of their load, for routers that prune.
//! * [`anchor_scores`]: the reimplemented peer routers' (dynamo, llm-d) per-row scores.
//! * [`scoring`]: the cost-model routers' per-row estimates, bit-identical to numpy's.
//!
//! The binding crate (`rust/python`) only converts types and releases the GIL.

pub mod anchor_scores;
pub mod backends;
pub mod content_key;
pub mod events;
pub mod index;
pub mod load_order;
pub mod namespace;
pub mod persist;
pub mod scoring;
pub mod shortlist;
pub mod speculative;
pub mod vllm_hash;
