//! Byte-exact parity with vLLM's `sha256_cbor` block hashes (`specs/block-hashing.md`).
//!
//! `h_i = SHA-256(CBOR([h_{i-1}, tokens_i, extra_i]))`, rooted at
//! `NONE_HASH = SHA-256(CBOR(seed))`, with CBOR in its canonical form (RFC 8949
//! §4.2.1: shortest heads, definite lengths). Events carry the last 8 bytes of each
//! digest, big-endian ([`event_hash`]). QuillCache indexes by its own content key;
//! this exists to predict and self-check engine hashes.

use sha2::{Digest as _, Sha256};

/// A full SHA-256 block digest.
pub type Digest = [u8; 32];

/// The seed vLLM >= 0.32 uses when PYTHONHASHSEED is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// One element of an extra key tuple, e.g. `("mm", "imghash", 2)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CborItem {
    Text(String),
    /// Any CBOR integer: `-(2^64) ..= 2^64 - 1`.
    Int(i128),
    Bytes(Vec<u8>),
}

/// One block's extra keys: a tuple of tuples, e.g. `(("lora", name, path), ("mm", h, 2))`.
pub type BlockExtra = Vec<Vec<CborItem>>;

const MAJOR_UINT: u8 = 0;
const MAJOR_NEGINT: u8 = 1;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// The shortest CBOR head for `major` and argument `n`.
fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= u8::MAX as u64 {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= u16::MAX as u64 {
        out.push(m | 25);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n <= u32::MAX as u64 {
        out.push(m | 26);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn write_item(out: &mut Vec<u8>, item: &CborItem) {
    match item {
        CborItem::Text(s) => {
            head(out, MAJOR_TEXT, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        CborItem::Bytes(b) => {
            head(out, MAJOR_BYTES, b.len() as u64);
            out.extend_from_slice(b);
        }
        // Out-of-range values are rejected by `CborItem::int`; clamp defensively.
        CborItem::Int(v) if *v >= 0 => head(out, MAJOR_UINT, (*v).min(u64::MAX as i128) as u64),
        CborItem::Int(v) => head(out, MAJOR_NEGINT, (-1 - *v).min(u64::MAX as i128) as u64),
    }
}

impl CborItem {
    /// An integer item, or None if CBOR cannot carry it.
    pub fn int(v: i128) -> Option<CborItem> {
        (-(1i128 << 64)..(1i128 << 64))
            .contains(&v)
            .then_some(CborItem::Int(v))
    }
}

/// `NONE_HASH`: SHA-256 of the CBOR text string `seed` (the default seed, or the
/// engine's PYTHONHASHSEED value).
pub fn none_hash(seed: &str) -> Digest {
    let mut buf = Vec::with_capacity(seed.len() + 9);
    write_item(&mut buf, &CborItem::Text(seed.to_owned()));
    Sha256::digest(&buf).into()
}

/// The canonical CBOR of `[parent, tokens, extra]` that vLLM hashes for one block.
pub fn block_cbor(
    parent: &Digest,
    tokens: &[u32],
    extra: Option<&[Vec<CborItem>]>,
    out: &mut Vec<u8>,
) {
    out.clear();
    head(out, MAJOR_ARRAY, 3);
    head(out, MAJOR_BYTES, 32);
    out.extend_from_slice(parent);
    head(out, MAJOR_ARRAY, tokens.len() as u64);
    for &t in tokens {
        head(out, MAJOR_UINT, t as u64);
    }
    match extra {
        None => out.push(NULL),
        Some(keys) => {
            head(out, MAJOR_ARRAY, keys.len() as u64);
            for key in keys {
                head(out, MAJOR_ARRAY, key.len() as u64);
                key.iter().for_each(|item| write_item(out, item));
            }
        }
    }
}

/// The digest of one block chained onto `parent`.
pub fn block_hash(parent: &Digest, tokens: &[u32], extra: Option<&[Vec<CborItem>]>) -> Digest {
    let mut buf = Vec::with_capacity(48 + 5 * tokens.len());
    block_cbor(parent, tokens, extra, &mut buf);
    Sha256::digest(&buf).into()
}

/// Digests of every full block of `tokens`, chained from `parent` (usually
/// [`none_hash`]). `extra[i]` holds block i's extra keys (missing = None).
pub fn block_hashes(
    parent: &Digest,
    tokens: &[u32],
    block_size: usize,
    extra: &[Option<BlockExtra>],
) -> Vec<Digest> {
    assert!(block_size > 0, "block_size must be positive");
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut buf = Vec::new();
    let mut prev = *parent;
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        let block_extra = extra.get(i).and_then(|e| e.as_deref());
        block_cbor(&prev, block, block_extra, &mut buf);
        prev = Sha256::digest(&buf).into();
        out.push(prev);
    }
    out
}

/// The 64-bit value vLLM's events carry: the digest's last 8 bytes, big-endian.
pub fn event_hash(digest: &Digest) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &Digest) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn none_hash_of_the_default_seed() {
        assert_eq!(
            hex(&none_hash(DEFAULT_SEED)),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }

    #[test]
    fn chain_vectors_of_block_hashing_md() {
        let tokens: Vec<u32> = (1..=12).collect();
        let got = block_hashes(&none_hash(DEFAULT_SEED), &tokens, 4, &[]);
        let expected = [
            (
                "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
                9561501211280363793,
            ),
            (
                "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
                15292913576410714033,
            ),
            (
                "321cf73a943519e37f9c8afa804132a5b9076e22b40b2d5fe6f7a2886960a68a",
                16642949654738151050,
            ),
        ];
        assert_eq!(got.len(), 3);
        for (d, (h, ev)) in got.iter().zip(expected) {
            assert_eq!(hex(d), h);
            assert_eq!(event_hash(d), ev);
        }
        // A partial trailing block gets no hash.
        assert_eq!(
            block_hashes(&none_hash(DEFAULT_SEED), &tokens[..11], 4, &[]).len(),
            2
        );
    }

    #[test]
    fn extra_keys_vector_of_block_hashing_md() {
        let t = |s: &str| CborItem::Text(s.into());
        let extra = vec![
            vec![t("lora"), t("my-lora"), t("/adapters/my-lora")],
            vec![t("mm"), t("imghash"), CborItem::Int(2)],
            vec![t("cache_salt"), t("tenant-a")],
        ];
        let d = block_hash(&none_hash(DEFAULT_SEED), &[1, 2, 3, 4], Some(&extra));
        let h = hex(&d);
        assert!(h.starts_with("41b93c4c") && h.ends_with("7d30c4"), "{h}");
    }

    #[test]
    fn cbor_heads_are_shortest() {
        let mut out = Vec::new();
        for (n, expected) in [
            (23u64, vec![0x17]),
            (24, vec![0x18, 24]),
            (255, vec![0x18, 255]),
            (256, vec![0x19, 1, 0]),
            (65536, vec![0x1a, 0, 1, 0, 0]),
            (1 << 32, vec![0x1b, 0, 0, 0, 1, 0, 0, 0, 0]),
        ] {
            out.clear();
            head(&mut out, MAJOR_UINT, n);
            assert_eq!(out, expected, "{n}");
        }
        out.clear();
        write_item(&mut out, &CborItem::Int(-25));
        assert_eq!(out, vec![0x38, 24]);
    }

    #[test]
    fn int_items_outside_cbor_range_are_refused() {
        assert!(CborItem::int(1 << 64).is_none());
        assert!(CborItem::int(-(1 << 64)).is_some());
        assert!(CborItem::int(-(1 << 64) - 1).is_none());
    }
}
