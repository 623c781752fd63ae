//! The on-disk frame of one log record:
//!
//! ```text
//! u32le body_len | u32le crc32(body_len_le ‖ body) | body
//! body = u64le lsn | u8 kind | u64le worker | u32le dp_rank | u64le seq | payload
//! ```
//!
//! The CRC covers the length too, so a damaged length is caught as surely as a
//! damaged body. Decoding never panics and never trusts a length beyond the input.

use crc32fast::Hasher;

/// `body_len` + `crc`.
pub const FRAME_HEADER: usize = 8;
/// lsn + kind + worker + dp_rank + seq.
pub const RECORD_HEADER: usize = 8 + 1 + 8 + 4 + 8;
/// No record is larger (a single event batch of 256 MiB would be a bug upstream).
pub const MAX_BODY: usize = 256 << 20;

/// One logical record, as the caller hands it to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// What the payload is; the log does not interpret it (see `durable::kind`).
    pub kind: u8,
    pub worker: u64,
    pub dp_rank: u32,
    /// The engine's sequence number of the batch (`u64::MAX` = not known).
    pub seq: u64,
    pub payload: &'a [u8],
}

/// A record read back, with its log sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoggedRecord<'a> {
    pub lsn: u64,
    pub record: Record<'a>,
}

pub fn frame_len(payload_len: usize) -> usize {
    FRAME_HEADER + RECORD_HEADER + payload_len
}

/// Appends the frame of `record` with number `lsn` to `out`.
pub fn encode(out: &mut Vec<u8>, lsn: u64, record: &Record<'_>) {
    let body_len = (RECORD_HEADER + record.payload.len()) as u32;
    let start = out.len();
    out.extend_from_slice(&body_len.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&lsn.to_le_bytes());
    out.push(record.kind);
    out.extend_from_slice(&record.worker.to_le_bytes());
    out.extend_from_slice(&record.dp_rank.to_le_bytes());
    out.extend_from_slice(&record.seq.to_le_bytes());
    out.extend_from_slice(record.payload);
    let mut h = Hasher::new();
    h.update(&out[start..start + 4]);
    h.update(&out[start + FRAME_HEADER..]);
    let crc = h.finalize();
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Why the bytes at some offset are not a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// Fewer bytes than the header or the announced body: typical of a torn write.
    Incomplete,
    /// The length is impossible (smaller than a record header or beyond `MAX_BODY`).
    BadLength,
    BadCrc,
}

impl Bad {
    pub fn describe(self) -> &'static str {
        match self {
            Bad::Incomplete => "incomplete frame",
            Bad::BadLength => "impossible frame length",
            Bad::BadCrc => "checksum mismatch",
        }
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Decodes the frame at `data[at..]`; on success also returns the offset after it.
pub fn decode(data: &[u8], at: usize) -> Result<(LoggedRecord<'_>, usize), Bad> {
    let rest = data.get(at..).unwrap_or(&[]);
    if rest.len() < FRAME_HEADER {
        return Err(Bad::Incomplete);
    }
    let body_len = u32_at(rest, 0) as usize;
    if !(RECORD_HEADER..=MAX_BODY).contains(&body_len) {
        return Err(Bad::BadLength);
    }
    if rest.len() < FRAME_HEADER + body_len {
        return Err(Bad::Incomplete);
    }
    let body = &rest[FRAME_HEADER..FRAME_HEADER + body_len];
    let mut h = Hasher::new();
    h.update(&rest[0..4]);
    h.update(body);
    if h.finalize() != u32_at(rest, 4) {
        return Err(Bad::BadCrc);
    }
    let rec = LoggedRecord {
        lsn: u64_at(body, 0),
        record: Record {
            kind: body[8],
            worker: u64_at(body, 9),
            dp_rank: u32_at(body, 17),
            seq: u64_at(body, 21),
            payload: &body[RECORD_HEADER..],
        },
    };
    Ok((rec, at + FRAME_HEADER + body_len))
}

/// After a bad frame at `bad_at`: the first offset beyond it where a valid frame with
/// an lsn at or after `expected_lsn` starts, if any. A torn tail has none; damage in
/// the middle of the log has one. Cheap: the CRC is checked only where the lsn fits.
pub fn find_valid_after(data: &[u8], bad_at: usize, expected_lsn: u64) -> Option<(usize, u64)> {
    let mut at = bad_at + 1;
    while at + FRAME_HEADER + RECORD_HEADER <= data.len() {
        let lsn = u64_at(data, at + FRAME_HEADER);
        if lsn >= expected_lsn && lsn - expected_lsn < (1 << 32) {
            if let Ok((rec, _)) = decode(data, at) {
                return Some((at, rec.lsn));
            }
        }
        at += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(payload: &[u8]) -> Record<'_> {
        Record {
            kind: 1,
            worker: 7,
            dp_rank: 2,
            seq: 99,
            payload,
        }
    }

    #[test]
    fn round_trip_and_every_truncation_is_incomplete() {
        let mut buf = Vec::new();
        encode(&mut buf, 5, &rec(b"hello"));
        assert_eq!(buf.len(), frame_len(5));
        let (got, next) = decode(&buf, 0).unwrap();
        assert_eq!(next, buf.len());
        assert_eq!(got.lsn, 5);
        assert_eq!(got.record, rec(b"hello"));
        for cut in 0..buf.len() {
            assert_eq!(
                decode(&buf[..cut], 0).unwrap_err(),
                Bad::Incomplete,
                "cut {cut}"
            );
        }
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let mut buf = Vec::new();
        encode(&mut buf, 1, &rec(b"payload bytes"));
        for byte in 0..buf.len() {
            for bit in 0..8 {
                let mut bad = buf.clone();
                bad[byte] ^= 1 << bit;
                assert!(decode(&bad, 0).is_err(), "flip {byte}:{bit} undetected");
            }
        }
    }

    #[test]
    fn finds_a_valid_frame_after_damage() {
        let mut buf = Vec::new();
        encode(&mut buf, 1, &rec(b"a"));
        let second = buf.len();
        encode(&mut buf, 2, &rec(b"bb"));
        buf[3] ^= 0x40; // damage the first frame's length
        assert!(decode(&buf, 0).is_err());
        assert_eq!(find_valid_after(&buf, 0, 1), Some((second, 2)));
        assert_eq!(find_valid_after(&buf, second, 3), None);
    }
}
