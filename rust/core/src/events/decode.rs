//! msgpack → [`EventBatch`]. (Placeholder: being written.)

use super::types::EventBatch;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} (at byte {offset})")]
pub struct DecodeError {
    pub message: String,
    pub offset: usize,
}

pub fn decode_batch(_bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    Err(DecodeError {
        message: "decoder not implemented yet".into(),
        offset: 0,
    })
}
