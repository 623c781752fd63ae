//! Key layout and value encoding of [`KvIndex`](super::KvIndex) in a key-value store.
//!
//! All integers in keys are big-endian so that key order = numeric order and a
//! source's or a parent's entries form one contiguous prefix range:
//!
//! | key | value |
//! |---|---|
//! | `N` key | node: parent, depth, pins, children, linked, holders |
//! | `C` parent child | (empty): the children of a node, for subtree scans |
//! | `E` worker dp group hash | content key: a source's engine-hash map |
//! | `S` worker dp | source: model, tokenizer, resident pairs |
//! | `M` | counters: blocks, nodes, resident pairs, pinned |

pub const NODE: u8 = b'N';
pub const CHILD: u8 = b'C';
pub const ENGINE: u8 = b'E';
pub const SOURCE: u8 = b'S';
pub const META: &[u8] = b"M";

pub fn node_key(key: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(9);
    k.push(NODE);
    k.extend_from_slice(&key.to_be_bytes());
    k
}

pub fn child_key(parent: u64, child: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(17);
    k.push(CHILD);
    k.extend_from_slice(&parent.to_be_bytes());
    k.extend_from_slice(&child.to_be_bytes());
    k
}

pub fn children_prefix(parent: u64) -> Vec<u8> {
    let mut k = vec![CHILD];
    k.extend_from_slice(&parent.to_be_bytes());
    k
}

pub fn source_prefix(worker: u64, dp_rank: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(13);
    k.extend_from_slice(&worker.to_be_bytes());
    k.extend_from_slice(&dp_rank.to_be_bytes());
    k
}

pub fn engine_key(worker: u64, dp_rank: u32, group: u32, hash: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(25);
    k.push(ENGINE);
    k.extend_from_slice(&source_prefix(worker, dp_rank));
    k.extend_from_slice(&group.to_be_bytes());
    k.extend_from_slice(&hash.to_be_bytes());
    k
}

pub fn engine_prefix(worker: u64, dp_rank: u32) -> Vec<u8> {
    let mut k = vec![ENGINE];
    k.extend_from_slice(&source_prefix(worker, dp_rank));
    k
}

pub fn source_key(worker: u64, dp_rank: u32) -> Vec<u8> {
    let mut k = vec![SOURCE];
    k.extend_from_slice(&source_prefix(worker, dp_rank));
    k
}

pub fn worker_sources_prefix(worker: u64) -> Vec<u8> {
    let mut k = vec![SOURCE];
    k.extend_from_slice(&worker.to_be_bytes());
    k
}

/// (worker, dp rank, medium, refcount), kept sorted by (worker, dp rank, medium).
pub type Holder = (u64, u32, String, u32);

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    pub parent: u64,
    pub depth: u32,
    pub pins: u32,
    pub children: u32,
    /// Created under an existing parent (so it counts in that parent's `children`).
    pub linked: bool,
    pub holders: Vec<Holder>,
}

impl Node {
    pub fn visible(&self) -> bool {
        !self.holders.is_empty() || self.pins > 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Source {
    pub model: String,
    pub tokenizer: String,
    pub pairs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Meta {
    pub blocks: u64,
    pub nodes: u64,
    pub pairs: u64,
    pub pinned: u64,
}

struct R<'a>(&'a [u8], usize);

impl R<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.0.get(self.1..self.1 + n)?;
        self.1 += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

fn put_str(o: &mut Vec<u8>, s: &str) {
    o.extend_from_slice(&(s.len() as u32).to_le_bytes());
    o.extend_from_slice(s.as_bytes());
}

pub fn encode_node(n: &Node) -> Vec<u8> {
    let mut o = Vec::with_capacity(32 + n.holders.len() * 24);
    o.extend_from_slice(&n.parent.to_le_bytes());
    o.extend_from_slice(&n.depth.to_le_bytes());
    o.extend_from_slice(&n.pins.to_le_bytes());
    o.extend_from_slice(&n.children.to_le_bytes());
    o.push(n.linked as u8);
    o.extend_from_slice(&(n.holders.len() as u32).to_le_bytes());
    for (w, dp, m, rc) in &n.holders {
        o.extend_from_slice(&w.to_le_bytes());
        o.extend_from_slice(&dp.to_le_bytes());
        put_str(&mut o, m);
        o.extend_from_slice(&rc.to_le_bytes());
    }
    o
}

pub fn decode_node(b: &[u8]) -> Option<Node> {
    let mut r = R(b, 0);
    let mut n = Node {
        parent: r.u64()?,
        depth: r.u32()?,
        pins: r.u32()?,
        children: r.u32()?,
        linked: r.u8()? != 0,
        holders: vec![],
    };
    let count = r.u32()? as usize;
    if count > b.len() {
        return None;
    }
    for _ in 0..count {
        n.holders.push((r.u64()?, r.u32()?, r.str()?, r.u32()?));
    }
    Some(n)
}

pub fn encode_source(s: &Source) -> Vec<u8> {
    let mut o = Vec::new();
    put_str(&mut o, &s.model);
    put_str(&mut o, &s.tokenizer);
    o.extend_from_slice(&s.pairs.to_le_bytes());
    o
}

pub fn decode_source(b: &[u8]) -> Option<Source> {
    let mut r = R(b, 0);
    Some(Source {
        model: r.str()?,
        tokenizer: r.str()?,
        pairs: r.u64()?,
    })
}

pub fn encode_meta(m: &Meta) -> Vec<u8> {
    [m.blocks, m.nodes, m.pairs, m.pinned]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect()
}

pub fn decode_meta(b: &[u8]) -> Option<Meta> {
    let mut r = R(b, 0);
    Some(Meta {
        blocks: r.u64()?,
        nodes: r.u64()?,
        pairs: r.u64()?,
        pinned: r.u64()?,
    })
}

pub fn u64_of(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
}

/// The last 8 big-endian bytes of a key (a node key in `C` keys, a hash in `E` keys).
pub fn tail_u64(k: &[u8]) -> u64 {
    let n = k.len();
    u64::from_be_bytes(k[n - 8..].try_into().expect("8 bytes"))
}
