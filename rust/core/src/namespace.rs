//! Identity: everything that decides whether two blocks with equal tokens may share
//! KV, reduced to a stable 64-bit id (`docs/content-key.md`, "Namespace id").

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::content_key::SEED;

const NAMESPACE_TAG: &[u8] = b"quillcache-ns-v1";

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Namespace {
    pub model: String,
    pub tokenizer: String,
    pub lora: String,
    pub tenant: String,
    pub block_size: u32,
    pub extra: Vec<String>,
}

fn push_field(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

impl Namespace {
    /// The canonical byte string that `id()` hashes.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(NAMESPACE_TAG);
        for s in [&self.model, &self.tokenizer, &self.lora, &self.tenant] {
            push_field(&mut buf, s);
        }
        buf.extend_from_slice(&self.block_size.to_le_bytes());
        buf.extend_from_slice(&(self.extra.len() as u32).to_le_bytes());
        for e in &self.extra {
            push_field(&mut buf, e);
        }
        buf
    }

    /// Stable across processes, machines and releases; the root of every key chain.
    pub fn id(&self) -> u64 {
        xxh3_64_with_seed(&self.canonical_bytes(), SEED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace {
            model: "m".into(),
            block_size: 16,
            ..Default::default()
        }
    }

    #[test]
    fn every_field_changes_the_id() {
        let base = ns().id();
        let variants = [
            Namespace {
                model: "m2".into(),
                ..ns()
            },
            Namespace {
                tokenizer: "t".into(),
                ..ns()
            },
            Namespace {
                lora: "l".into(),
                ..ns()
            },
            Namespace {
                tenant: "a".into(),
                ..ns()
            },
            Namespace {
                block_size: 32,
                ..ns()
            },
            Namespace {
                extra: vec!["x".into()],
                ..ns()
            },
        ];
        for v in variants {
            assert_ne!(v.id(), base, "{v:?}");
        }
    }

    #[test]
    fn fields_do_not_run_into_each_other() {
        let a = Namespace {
            model: "ab".into(),
            tokenizer: "".into(),
            ..ns()
        };
        let b = Namespace {
            model: "a".into(),
            tokenizer: "b".into(),
            ..ns()
        };
        assert_ne!(a.id(), b.id());
    }
}
