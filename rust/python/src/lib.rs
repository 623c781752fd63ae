//! `quillcache._native`: PyO3 glue only. Type conversion and GIL release live here;
//! all logic lives in `quillcache-core`.

use pyo3::prelude::*;

mod anchor_scores;
mod convert;
mod durable;
mod errors;
mod events;
mod hashing;
mod index;
mod kv_index;
mod load_order;
mod matches;
mod reads;
mod relay;
mod scoring;
mod speculative;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    hashing::register(m)?;
    events::register(m)?;
    index::register(m)?;
    durable::register(m)?;
    kv_index::register(m)?;
    relay::register(m)?;
    speculative::register(m)?;
    scoring::register(m)?;
    anchor_scores::register(m)?;
    load_order::register(m)?;
    Ok(())
}
