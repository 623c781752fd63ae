//! An in-memory ordered store: the reference [`KvStore`] for tests.

use std::collections::BTreeMap;

use super::{KvError, KvOp, KvPair, KvStore};

#[derive(Debug, Default, Clone)]
pub struct MemKv {
    map: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl MemKv {
    pub fn new() -> Self {
        Self::default()
    }
}

impl KvStore for MemKv {
    fn multi_get(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        Ok(keys.iter().map(|k| self.map.get(k).cloned()).collect())
    }

    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<KvPair>, KvError> {
        Ok(self
            .map
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn write(&mut self, ops: Vec<KvOp>) -> Result<(), KvError> {
        for (k, v) in ops {
            match v {
                Some(v) => self.map.insert(k, v),
                None => self.map.remove(&k),
            };
        }
        Ok(())
    }

    fn memory_bytes(&self) -> u64 {
        self.map
            .iter()
            .map(|(k, v)| (k.len() + v.len() + 48) as u64)
            .sum()
    }
}
