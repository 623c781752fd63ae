//! The residency index. (Being written.)
