//! `quillcache._native`: PyO3 glue only. Type conversion and GIL release live here;
//! all logic lives in `quillcache-core`.

use pyo3::prelude::*;

mod errors;
mod events;
mod hashing;
mod index;
mod matches;
mod persist;
mod relay;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    hashing::register(m)?;
    events::register(m)?;
    index::register(m)?;
    persist::register(m)?;
    relay::register(m)?;
    Ok(())
}
