//! QuillCache's chained content key (`docs/content-key.md`, "Chained block key").
//!
//! One 64-bit key names a whole prefix: `key_i = xxh3(parent ‖ tokens_i ‖ mm_i)`,
//! with the chain rooted at the namespace id.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of every QuillCache hash: ASCII `qullck01` read big-endian.
pub const SEED: u64 = 0x7175_6c6c_636b_3031;

/// A multimodal item overlapping a block: `(mm_hash, offset_in_block)`.
pub type MmItem = (String, i64);

/// Key of one block given its parent key (the namespace id for block 0).
#[inline]
///
/// An empty item list is the same as none: `mm_i` is empty for a block without
/// multimodal items (`docs/content-key.md`).
pub fn chain_block(parent: u64, tokens: &[u32], mm: Option<&[MmItem]>) -> u64 {
    let mm = mm.filter(|items| !items.is_empty());
    // Stack buffer for the common case (blocks up to 128 tokens, no mm items).
    const STACK_TOKENS: usize = 128;
    if mm.is_none() && tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; 8 + 4 * STACK_TOKENS];
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        for (dst, t) in buf[8..].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&buf[..8 + 4 * tokens.len()], SEED);
    }
    let mut buf = Vec::with_capacity(8 + 4 * tokens.len() + 64);
    buf.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    if let Some(items) = mm {
        buf.extend_from_slice(&(items.len() as u32).to_le_bytes());
        for (hash, offset) in items {
            buf.extend_from_slice(&(hash.len() as u32).to_le_bytes());
            buf.extend_from_slice(hash.as_bytes());
            buf.extend_from_slice(&offset.to_le_bytes());
        }
    }
    xxh3_64_with_seed(&buf, SEED)
}

/// Appends the keys of every full block of `tokens` to `out`; a partial tail gets none.
pub fn chain_keys(parent: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    assert!(block_size > 0, "block_size must be positive");
    out.reserve(tokens.len() / block_size);
    let mut key = parent;
    if block_size <= 128 {
        for block in tokens.chunks_exact(block_size) {
            key = chain_block(key, block, None);
            out.push(key);
        }
        return;
    }
    // Large blocks: one reused buffer instead of an allocation per block.
    let mut buf = Vec::with_capacity(8 + 4 * block_size);
    for block in tokens.chunks_exact(block_size) {
        buf.clear();
        buf.extend_from_slice(&key.to_le_bytes());
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        key = xxh3_64_with_seed(&buf, SEED);
        out.push(key);
    }
}

/// Like [`chain_keys`], with block i's multimodal items in `mm[i]` (missing = none).
pub fn chain_keys_mm(
    parent: u64,
    tokens: &[u32],
    block_size: usize,
    mm: &[Option<Vec<MmItem>>],
    out: &mut Vec<u64>,
) {
    assert!(block_size > 0, "block_size must be positive");
    out.reserve(tokens.len() / block_size);
    let mut key = parent;
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        key = chain_block(key, block, mm.get(i).and_then(|m| m.as_deref()));
        out.push(key);
    }
}

/// Keys of many sequences at once: sequence j is `tokens[offsets[j]..offsets[j+1]]`,
/// chained from `parents[j]`. Appends its keys to `out` and returns, per sequence, the
/// end of its keys in `out` (so sequence j's keys are `out[ends[j-1]..ends[j]]`).
///
/// `offsets` must be non-decreasing and within `tokens`; callers validate.
pub fn chain_keys_batch(
    parents: impl Fn(usize) -> u64,
    tokens: &[u32],
    offsets: &[usize],
    block_size: usize,
    out: &mut Vec<u64>,
) -> Vec<usize> {
    let mut ends = Vec::with_capacity(offsets.len().saturating_sub(1));
    for (j, w) in offsets.windows(2).enumerate() {
        chain_keys(parents(j), &tokens[w[0]..w[1]], block_size, out);
        ends.push(out.len());
    }
    ends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_use_the_same_bytes() {
        let toks: Vec<u32> = (0..1000).collect();
        let mut out = Vec::new();
        chain_keys(3, &toks, 300, &mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0], chain_block(3, &toks[..300], None));
        assert_eq!(out[2], chain_block(out[1], &toks[600..900], None));
    }

    #[test]
    fn partial_tail_gets_no_key() {
        let mut out = Vec::new();
        chain_keys(7, &[1, 2, 3, 4, 5], 2, &mut out);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn chain_is_prefix_stable() {
        let toks: Vec<u32> = (0..64).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        chain_keys(1, &toks, 16, &mut a);
        chain_keys(1, &toks[..32], 16, &mut b);
        assert_eq!(&a[..2], &b[..]);
        assert_eq!(a[1], chain_block(a[0], &toks[16..32], None));
    }

    /// `tests/vectors/content_key.json`, generated from the Python reference.
    #[test]
    fn reference_vectors() {
        use crate::namespace::Namespace;
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/vectors/content_key.json")).unwrap();
        assert_eq!(doc["seed"].as_u64(), Some(SEED));
        let str_of = |v: &serde_json::Value| v.as_str().unwrap().to_string();
        let namespaces: Vec<(Namespace, u64)> = doc["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                let ns = Namespace {
                    model: str_of(&n["model"]),
                    tokenizer: str_of(&n["tokenizer"]),
                    lora: str_of(&n["lora"]),
                    tenant: str_of(&n["tenant"]),
                    block_size: n["block_size"].as_u64().unwrap() as u32,
                    extra: n["extra"].as_array().unwrap().iter().map(str_of).collect(),
                };
                (ns, n["id"].as_u64().unwrap())
            })
            .collect();
        for (ns, id) in &namespaces {
            assert_eq!(ns.id(), *id, "{ns:?}");
        }
        let chains = doc["chains"].as_array().unwrap();
        assert!(chains.len() >= 5);
        for chain in chains {
            let (ns, id) = &namespaces[chain["namespace"].as_u64().unwrap() as usize];
            let tokens: Vec<u32> = chain["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let mm: Vec<Option<Vec<MmItem>>> = chain["mm"]
                .as_array()
                .map(|blocks| {
                    blocks
                        .iter()
                        .map(|b| {
                            b.as_array().map(|items| {
                                items
                                    .iter()
                                    .map(|i| (str_of(&i[0]), i[1].as_i64().unwrap()))
                                    .collect()
                            })
                        })
                        .collect()
                })
                .unwrap_or_default();
            let expected: Vec<u64> = chain["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_u64().unwrap())
                .collect();
            let mut got = Vec::new();
            chain_keys_mm(*id, &tokens, ns.block_size as usize, &mm, &mut got);
            assert_eq!(got, expected, "{chain}");
        }
    }

    #[test]
    fn batch_equals_one_call_per_sequence() {
        let toks: Vec<u32> = (0..100).collect();
        let offsets = [0, 10, 10, 47, 100];
        let mut flat = Vec::new();
        let ends = chain_keys_batch(|j| j as u64, &toks, &offsets, 4, &mut flat);
        let mut start = 0;
        for (j, w) in offsets.windows(2).enumerate() {
            let mut one = Vec::new();
            chain_keys(j as u64, &toks[w[0]..w[1]], 4, &mut one);
            assert_eq!(&flat[start..ends[j]], &one[..]);
            start = ends[j];
        }
    }

    #[test]
    fn mm_chain_without_items_equals_plain_chain() {
        let toks: Vec<u32> = (0..33).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        chain_keys(5, &toks, 8, &mut a);
        chain_keys_mm(5, &toks, 8, &[None, Some(vec![])], &mut b);
        assert_eq!(a, b, "no items and an empty item list are the same block");
    }

    #[test]
    fn mm_items_change_the_key() {
        let toks = [1u32, 2, 3, 4];
        let plain = chain_block(0, &toks, None);
        let with_mm = chain_block(0, &toks, Some(&[("img".to_string(), 0)]));
        assert_ne!(plain, with_mm);
    }
}
