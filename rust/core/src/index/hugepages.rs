//! Transparent huge pages for the index's large arrays (the node slab, the two
//! key tables).
//!
//! Each 4 KiB page of a fresh array costs a page fault on first touch: faults in
//! `Tree::get_or_insert` and in the tables' fill are a visible share of ingest in a
//! profile. An array advised `MADV_HUGEPAGE` is faulted 2 MiB at a time, and its
//! random reads (matching, table probes) walk fewer TLB entries. The advice is only
//! advice: where the system's THP mode is `never`, or off Linux, nothing changes.
//! Measurements: docs/results/residency-index.md.

/// Arrays smaller than one huge page are left alone.
const MIN_BYTES: usize = 2 << 20;

/// Advises huge pages for the whole allocation of `v` (its spare capacity too), if
/// it spans at least one huge page. Call it once the allocation exists and, for an
/// array filled at once, before filling it (the fill is what faults the pages).
pub(super) fn advise<T>(v: &Vec<T>) {
    let bytes = v.capacity().saturating_mul(std::mem::size_of::<T>());
    if bytes < MIN_BYTES {
        return;
    }
    if let Some((first, end)) = advised_span(v.as_ptr() as usize, bytes, page_size()) {
        madvise_huge(first, end);
    }
}

/// The inside `[first, end)` of an allocation of `bytes` at `start` aligned to
/// `page` (madvise takes page-aligned ranges only), if it is not empty.
fn advised_span(start: usize, bytes: usize, page: usize) -> Option<(usize, usize)> {
    let first = start.checked_next_multiple_of(page)?;
    let end = start.checked_add(bytes)? & !(page - 1);
    (end > first).then_some((first, end))
}

#[cfg(target_os = "linux")]
fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

#[cfg(target_os = "linux")]
fn madvise_huge(first: usize, end: usize) {
    // SAFETY: [first, end) lies inside one live allocation; MADV_HUGEPAGE changes how
    // its pages are backed, never their contents. A failure (a kernel without THP)
    // leaves the small pages, which is fine.
    unsafe {
        libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn page_size() -> usize {
    4096
}

#[cfg(not(target_os = "linux"))]
fn madvise_huge(_first: usize, _end: usize) {}

/// A vector of `len` copies of `value`, huge pages advised before it is filled.
pub(super) fn filled<T: Clone>(len: usize, value: T) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    advise(&v);
    v.resize(len, value);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_span_is_the_page_aligned_inside_of_the_allocation() {
        let mib = 1 << 20;
        assert_eq!(
            advised_span(4096, 2 * mib, 4096),
            Some((4096, 4096 + 2 * mib))
        );
        assert_eq!(
            advised_span(4097, 2 * mib, 4096),
            Some((8192, 4096 + 2 * mib))
        );
        assert_eq!(advised_span(4097, 2 * mib, 65536), Some((65536, 2 * mib)));
        assert_eq!(advised_span(4097, 4000, 4096), None);
        assert_eq!(advised_span(usize::MAX - 10, 2 * mib, 4096), None);
    }

    /// The mappings of /proc/self/smaps whose VmFlags have `hg` (MADV_HUGEPAGE).
    #[cfg(target_os = "linux")]
    fn advised_mappings() -> Vec<(usize, usize)> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut out = vec![];
        let mut current = None;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            let range = head.split_once('-').and_then(|(a, b)| {
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            });
            if range.is_some() {
                current = range;
            } else if let (Some(range), Some(flags)) = (current, line.strip_prefix("VmFlags:")) {
                if flags.split_whitespace().any(|f| f == "hg") {
                    out.push(range);
                }
            }
        }
        out
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_filled_array_is_advised_and_keeps_its_contents() {
        let v: Vec<u32> = filled(3 << 20, 7); // 12 MiB
        assert!(v.iter().all(|&x| x == 7));
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            return; // a kernel without THP refuses the advice
        }
        let (first, end) =
            advised_span(v.as_ptr() as usize, v.capacity() * 4, page_size()).unwrap();
        let mappings = advised_mappings();
        let advised = |p: usize| mappings.iter().any(|&(a, b)| a <= p && p < b);
        assert!(
            advised(first) && advised(end - 1),
            "{first:#x}..{end:#x} not advised"
        );
    }
}
