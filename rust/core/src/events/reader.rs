//! A bounds-checked msgpack cursor over a byte slice.
//!
//! Markers are classified by `rmp::Marker`; every length a value declares is checked
//! against the bytes that are left *before* anything is sliced or allocated, so a
//! 2 GiB length prefix in a 20-byte payload is an error, not an allocation.

use rmp::Marker;

use super::decode::DecodeError;

/// Deepest container nesting accepted anywhere (the batch array is depth 1).
pub const MAX_DEPTH: usize = 32;

/// An integer as msgpack carries it: the union of the int64 and uint64 ranges.
pub type WireInt = i128;

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Where we are, for error messages: e.g. `events[3].token_ids`.
    pub path: Path,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Batch,
    BatchField(&'static str),
    Event(usize),
    EventField(usize, &'static str),
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Path::Batch => write!(f, "batch"),
            Path::BatchField(name) => write!(f, "batch.{name}"),
            Path::Event(i) => write!(f, "events[{i}]"),
            Path::EventField(i, name) => write!(f, "events[{i}].{name}"),
        }
    }
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader {
            buf,
            pos: 0,
            path: Path::Batch,
        }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn slice(&self, start: usize, end: usize) -> &'a [u8] {
        &self.buf[start..end]
    }

    /// An error at byte `offset`, prefixed with the current path.
    pub fn error_at(&self, offset: usize, what: impl std::fmt::Display) -> DecodeError {
        DecodeError {
            message: format!("{}: {what}", self.path),
            offset,
        }
    }

    pub fn error(&self, what: impl std::fmt::Display) -> DecodeError {
        self.error_at(self.pos, what)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.remaining() {
            return Err(self.error(format_args!(
                "truncated: a value needs {n} more bytes, {} left",
                self.remaining()
            )));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len_u8(&mut self) -> Result<usize, DecodeError> {
        Ok(self.be::<1>()?[0] as usize)
    }
    fn len_u16(&mut self) -> Result<usize, DecodeError> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    fn len_u32(&mut self) -> Result<usize, DecodeError> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    pub fn peek(&self) -> Result<Marker, DecodeError> {
        match self.buf.get(self.pos) {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => Err(self.error("truncated: expected a value, found end of input")),
        }
    }

    fn marker(&mut self) -> Result<Marker, DecodeError> {
        let m = self.peek()?;
        self.pos += 1;
        Ok(m)
    }

    pub fn is_nil(&self) -> Result<bool, DecodeError> {
        Ok(matches!(self.peek()?, Marker::Null))
    }

    /// Consumes a nil if there is one; true if it did.
    pub fn eat_nil(&mut self) -> Result<bool, DecodeError> {
        let nil = self.is_nil()?;
        if nil {
            self.pos += 1;
        }
        Ok(nil)
    }

    fn unexpected(&self, start: usize, expected: &str, found: Marker) -> DecodeError {
        self.error_at(
            start,
            format_args!("expected {expected}, found {}", describe(found)),
        )
    }

    /// An array header; the declared length is checked against the bytes left.
    pub fn array_len(&mut self, what: &str) -> Result<usize, DecodeError> {
        let start = self.pos;
        let n = match self.marker()? {
            Marker::FixArray(n) => n as usize,
            Marker::Array16 => self.len_u16()?,
            Marker::Array32 => self.len_u32()?,
            m => return Err(self.unexpected(start, &format!("{what} (an array)"), m)),
        };
        if n > self.remaining() {
            return Err(self.error_at(
                start,
                format_args!("array declares {n} elements, more than the bytes left"),
            ));
        }
        Ok(n)
    }

    /// A map header (caller has peeked a map marker); 2 entries need >= 2 bytes each.
    pub fn map_len(&mut self) -> Result<usize, DecodeError> {
        let start = self.pos;
        let n = match self.marker()? {
            Marker::FixMap(n) => n as usize,
            Marker::Map16 => self.len_u16()?,
            Marker::Map32 => self.len_u32()?,
            m => return Err(self.unexpected(start, "a map", m)),
        };
        if n.saturating_mul(2) > self.remaining() {
            return Err(self.error_at(
                start,
                format_args!("map declares {n} entries, more than the bytes left"),
            ));
        }
        Ok(n)
    }

    /// The raw bytes of a str value (not yet UTF-8 checked), or None if it is not a str.
    #[inline]
    fn str_bytes(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        // A fixstr that fits (every field name and common value): no marker decoding.
        if let Some(&b) = self.buf.get(self.pos) {
            if b & 0xe0 == 0xa0 {
                let n = (b & 0x1f) as usize;
                if let Some(s) = self.buf.get(self.pos + 1..self.pos + 1 + n) {
                    self.pos += 1 + n;
                    return Ok(Some(s));
                }
            }
        }
        let n = match self.peek()? {
            Marker::FixStr(n) => {
                self.pos += 1;
                n as usize
            }
            Marker::Str8 => {
                self.pos += 1;
                self.len_u8()?
            }
            Marker::Str16 => {
                self.pos += 1;
                self.len_u16()?
            }
            Marker::Str32 => {
                self.pos += 1;
                self.len_u32()?
            }
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    pub fn str(&mut self, what: &str) -> Result<&'a str, DecodeError> {
        let start = self.pos;
        let bytes = self.str_raw(what)?;
        self.utf8(bytes, start, what)
    }

    /// The bytes of a str value, not UTF-8 checked: a caller that compares them with
    /// known ASCII names checks (with [`Reader::utf8`]) only what matches none.
    #[inline]
    pub fn str_raw(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let start = self.pos;
        match self.str_bytes()? {
            Some(bytes) => Ok(bytes),
            None => Err(self.unexpected(start, &format!("{what} (a string)"), self.peek()?)),
        }
    }

    /// `bytes` (a str value that started at `start`) as UTF-8, or the error `str` gives.
    pub fn utf8(&self, bytes: &'a [u8], start: usize, what: &str) -> Result<&'a str, DecodeError> {
        std::str::from_utf8(bytes)
            .map_err(|e| self.error_at(start, format_args!("{what} is not valid UTF-8 ({e})")))
    }

    /// Fast path for an engine hash: a uint64 or a positive fixint. None (nothing
    /// consumed) otherwise; the caller then takes the general path.
    #[inline]
    pub fn fast_u64(&mut self) -> Option<u64> {
        let rest = &self.buf[self.pos..];
        match *rest.first()? {
            0xcf => {
                let b: [u8; 8] = rest.get(1..9)?.try_into().ok()?;
                self.pos += 9;
                Some(u64::from_be_bytes(b))
            }
            b @ 0x00..=0x7f => {
                self.pos += 1;
                Some(b as u64)
            }
            _ => None,
        }
    }

    /// A str that is valid UTF-8, or None (position unspecified) for anything else.
    pub fn try_str(&mut self) -> Option<&'a str> {
        match self.str_bytes() {
            Ok(Some(bytes)) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }

    /// Fast path for a run of token ids: appends elements read by [`Reader::fast_u32`]'s
    /// rules to `out` until `out` holds `n` or an element needs the general path
    /// (nothing of it consumed). One tight loop over the slice,
    /// without re-slicing per element: the per-token cost of decoding a long prompt.
    #[inline]
    pub fn fast_u32_run(&mut self, n: usize, out: &mut Vec<u32>) {
        let buf = self.buf;
        let mut pos = self.pos;
        out.reserve(n.saturating_sub(out.len()));
        while out.len() < n {
            // Five bytes cover the widest element; near the end, go element by element.
            let Some(w) = buf.get(pos..pos + 5) else {
                self.pos = pos;
                while out.len() < n {
                    match self.fast_u32() {
                        Some(v) => out.push(v),
                        None => return,
                    }
                }
                return;
            };
            // uint16 ids (vocabularies of 256..65535 tokens: most of them) four at a
            // time, with fixed offsets instead of a chain of variable-length steps.
            if w[0] == 0xcd && n - out.len() >= 4 {
                if let Some(q) = buf.get(pos..pos + 12) {
                    if q[3] == 0xcd && q[6] == 0xcd && q[9] == 0xcd {
                        out.extend_from_slice(&[
                            u16::from_be_bytes([q[1], q[2]]) as u32,
                            u16::from_be_bytes([q[4], q[5]]) as u32,
                            u16::from_be_bytes([q[7], q[8]]) as u32,
                            u16::from_be_bytes([q[10], q[11]]) as u32,
                        ]);
                        pos += 12;
                        continue;
                    }
                }
            }
            let (v, len) = match w[0] {
                b @ 0x00..=0x7f => (b as u32, 1),
                0xcd => (u16::from_be_bytes([w[1], w[2]]) as u32, 3),
                0xcc => (w[1] as u32, 2),
                0xce => (u32::from_be_bytes([w[1], w[2], w[3], w[4]]), 5),
                _ => break,
            };
            out.push(v);
            pos += len;
        }
        self.pos = pos;
    }

    /// Fast path for token ids: a uint in the u32 range written as fixint, uint8,
    /// uint16 or uint32 (what every encoder writes). None (nothing consumed) otherwise;
    /// the caller then takes the general path.
    #[inline]
    pub fn fast_u32(&mut self) -> Option<u32> {
        let rest = &self.buf[self.pos..];
        let (v, len) = match *rest.first()? {
            b @ 0x00..=0x7f => (b as u32, 1),
            0xcc if rest.len() >= 2 => (rest[1] as u32, 2),
            0xcd if rest.len() >= 3 => (u16::from_be_bytes([rest[1], rest[2]]) as u32, 3),
            0xce if rest.len() >= 5 => {
                (u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]), 5)
            }
            _ => return None,
        };
        self.pos += len;
        Some(v)
    }

    /// An int of any msgpack width, or None (nothing consumed) if the value is not an int.
    pub fn try_int(&mut self) -> Result<Option<WireInt>, DecodeError> {
        let v: WireInt = match self.peek()? {
            Marker::FixPos(n) => {
                self.pos += 1;
                n as WireInt
            }
            Marker::FixNeg(n) => {
                self.pos += 1;
                n as WireInt
            }
            Marker::U8 => {
                self.pos += 1;
                u8::from_be_bytes(self.be()?) as WireInt
            }
            Marker::U16 => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as WireInt
            }
            Marker::U32 => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as WireInt
            }
            Marker::U64 => {
                self.pos += 1;
                u64::from_be_bytes(self.be()?) as WireInt
            }
            Marker::I8 => {
                self.pos += 1;
                i8::from_be_bytes(self.be()?) as WireInt
            }
            Marker::I16 => {
                self.pos += 1;
                i16::from_be_bytes(self.be()?) as WireInt
            }
            Marker::I32 => {
                self.pos += 1;
                i32::from_be_bytes(self.be()?) as WireInt
            }
            Marker::I64 => {
                self.pos += 1;
                i64::from_be_bytes(self.be()?) as WireInt
            }
            _ => return Ok(None),
        };
        Ok(Some(v))
    }

    /// An int within `lo..=hi`.
    pub fn int_in(&mut self, what: &str, lo: WireInt, hi: WireInt) -> Result<WireInt, DecodeError> {
        let start = self.pos;
        match self.try_int()? {
            Some(v) if (lo..=hi).contains(&v) => Ok(v),
            Some(v) => Err(self.error_at(
                start,
                format_args!("expected {what} (an int in {lo}..{hi}), got {v}"),
            )),
            None => Err(self.unexpected(start, &format!("{what} (an int)"), self.peek()?)),
        }
    }

    /// A float (f32 widened) or an int converted to f64.
    pub fn number(&mut self, what: &str) -> Result<f64, DecodeError> {
        let start = self.pos;
        match self.peek()? {
            Marker::F32 => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            Marker::F64 => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            m => match self.try_int()? {
                Some(v) => Ok(v as f64),
                None => Err(self.unexpected(start, &format!("{what} (a number)"), m)),
            },
        }
    }

    /// A bin value's bytes, or None (nothing consumed) if the value is not bin.
    pub fn try_bin(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let n = match self.peek()? {
            Marker::Bin8 => {
                self.pos += 1;
                self.len_u8()?
            }
            Marker::Bin16 => {
                self.pos += 1;
                self.len_u16()?
            }
            Marker::Bin32 => {
                self.pos += 1;
                self.len_u32()?
            }
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    /// Skips one value of any type. `depth` is the depth the value sits at; a container
    /// deeper than [`MAX_DEPTH`] is an error (bounded recursion, bounded work).
    pub fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        let marker = self.peek()?;
        let children = match marker {
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                if depth > MAX_DEPTH {
                    return Err(self.error(format_args!("nesting deeper than {MAX_DEPTH} levels")));
                }
                self.array_len("")?
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                if depth > MAX_DEPTH {
                    return Err(self.error(format_args!("nesting deeper than {MAX_DEPTH} levels")));
                }
                2 * self.map_len()?
            }
            Marker::Reserved => {
                return Err(self.error("malformed msgpack: reserved marker 0xc1"));
            }
            _ => {
                self.pos += 1;
                let payload = match marker {
                    Marker::FixPos(_)
                    | Marker::FixNeg(_)
                    | Marker::Null
                    | Marker::True
                    | Marker::False => 0,
                    Marker::U8 | Marker::I8 => 1,
                    Marker::U16 | Marker::I16 => 2,
                    Marker::U32 | Marker::I32 | Marker::F32 => 4,
                    Marker::U64 | Marker::I64 | Marker::F64 => 8,
                    Marker::FixStr(n) => n as usize,
                    Marker::Str8 | Marker::Bin8 => self.len_u8()?,
                    Marker::Str16 | Marker::Bin16 => self.len_u16()?,
                    Marker::Str32 | Marker::Bin32 => self.len_u32()?,
                    Marker::FixExt1 => 2,
                    Marker::FixExt2 => 3,
                    Marker::FixExt4 => 5,
                    Marker::FixExt8 => 9,
                    Marker::FixExt16 => 17,
                    Marker::Ext8 => self.len_u8()? + 1,
                    Marker::Ext16 => self.len_u16()? + 1,
                    Marker::Ext32 => self.len_u32()? + 1,
                    // Containers and 0xc1 are handled above; keep the match total anyway.
                    _ => return Err(self.error("malformed msgpack: unexpected marker")),
                };
                self.take(payload)?;
                return Ok(());
            }
        };
        for _ in 0..children {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}

fn describe(m: Marker) -> String {
    let kind = match m {
        Marker::FixPos(_) | Marker::FixNeg(_) => "an int",
        Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => "an int",
        Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => "an int",
        Marker::Null => "nil",
        Marker::True | Marker::False => "a bool",
        Marker::F32 | Marker::F64 => "a float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "a string",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bytes",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "an array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "a map",
        Marker::Reserved => "the reserved marker",
        _ => "an ext value",
    };
    format!("{kind} (marker 0x{:02x})", m.to_u8())
}
