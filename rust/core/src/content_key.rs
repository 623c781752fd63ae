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
pub fn chain_block(parent: u64, tokens: &[u32], mm: Option<&[MmItem]>) -> u64 {
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
    for block in tokens.chunks_exact(block_size) {
        key = chain_block(key, block, None);
        out.push(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn mm_items_change_the_key() {
        let toks = [1u32, 2, 3, 4];
        let plain = chain_block(0, &toks, None);
        let with_mm = chain_block(0, &toks, Some(&[("img".to_string(), 0)]));
        assert_ne!(plain, with_mm);
    }
}
