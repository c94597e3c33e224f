//! Weights in transparent huge pages, on Linux.
//!
//! A decode step streams every weight once, at the memory's full rate; with
//! 4 KiB pages that is a page walk every 4 KiB per stream, which the
//! prefetchers cannot hide, and a GEMV reads less than from 2 MiB pages.
//! Weights are loaded into memory malloc
//! already touched, which `MADV_HUGEPAGE` alone does not change, so the
//! pages are collapsed in place (`MADV_COLLAPSE`, Linux 6.1) at load.

/// Asks the kernel to back `data` with huge pages, now. Best effort: on
/// older kernels, other systems, or with THP off, nothing changes.
pub fn back_with_huge_pages<T>(data: &[T]) {
    advise(data.as_ptr().cast(), std::mem::size_of_val(data));
}

#[cfg(target_os = "linux")]
fn advise(ptr: *const u8, len: usize) {
    /// Below this nothing fills one 2 MiB page.
    const HUGE_PAGE: usize = 2 << 20;
    const PAGE: usize = 4096;
    /// `MADV_COLLAPSE` (Linux 6.1), not in every libc crate version.
    const MADV_COLLAPSE: libc::c_int = 25;
    if len < HUGE_PAGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(PAGE);
    let end = (ptr as usize + len) / PAGE * PAGE;
    if end <= start {
        return;
    }
    // SAFETY: [start, end) lies inside the live allocation behind `data`;
    // both calls change how it is backed, never its contents, and report
    // failure (ignored: the pages stay small) rather than fault.
    unsafe {
        let range = start as *mut libc::c_void;
        libc::madvise(range, end - start, libc::MADV_HUGEPAGE);
        libc::madvise(range, end - start, MADV_COLLAPSE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise(_ptr: *const u8, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_leaves_the_data_alone() {
        let data: Vec<u16> = (0..(5 << 20) as u32).map(|i| (i * 7) as u16).collect();
        let copy = data.clone();
        back_with_huge_pages(&data);
        back_with_huge_pages(&data[3..]);
        back_with_huge_pages::<f32>(&[]);
        assert_eq!(data, copy);
    }
}
