//! What the index benchmarks share: a seeded mixer and generator, vLLM's BlockStored
//! batch in its wire form, and this thread's CPU time. Each bench uses a part of it.
#![allow(dead_code)]

/// splitmix64's finaliser.
pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

/// A deterministic generator (splitmix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        mix(self.0)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A BlockStored batch in vLLM's map form: `[ts, [event], 0]`, blocks of `block_size`.
pub fn encode_stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    block_size: usize,
) -> Vec<u8> {
    use rmp::encode::*;
    let mut w = Vec::with_capacity(64 + tokens.len() * 3 + hashes.len() * 9);
    write_array_len(&mut w, 3).unwrap();
    write_f64(&mut w, 1.0).unwrap();
    write_array_len(&mut w, 1).unwrap();
    write_map_len(&mut w, 8).unwrap();
    write_str(&mut w, "type").unwrap();
    write_str(&mut w, "BlockStored").unwrap();
    write_str(&mut w, "block_hashes").unwrap();
    write_array_len(&mut w, hashes.len() as u32).unwrap();
    for &h in hashes {
        write_u64(&mut w, h).unwrap();
    }
    write_str(&mut w, "parent_block_hash").unwrap();
    match parent {
        Some(p) => write_u64(&mut w, p).unwrap(),
        None => write_nil(&mut w).unwrap(),
    }
    write_str(&mut w, "token_ids").unwrap();
    write_array_len(&mut w, tokens.len() as u32).unwrap();
    for &t in tokens {
        write_uint(&mut w, t as u64).unwrap();
    }
    write_str(&mut w, "block_size").unwrap();
    write_uint(&mut w, block_size as u64).unwrap();
    write_str(&mut w, "lora_id").unwrap();
    write_nil(&mut w).unwrap();
    write_str(&mut w, "medium").unwrap();
    write_str(&mut w, "GPU").unwrap();
    write_str(&mut w, "lora_name").unwrap();
    write_nil(&mut w).unwrap();
    write_uint(&mut w, 0).unwrap(); // dp_rank
    w
}

/// CPU time of this thread (utime + stime from /proc, in clock ticks of 1/100 s).
pub fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let after_comm = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the comm field.
    (ticks(11) + ticks(12)) / 100.0
}
