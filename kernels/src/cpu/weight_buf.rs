//! Weight arrays placed for huge pages.
//!
//! A decode step streams every weight once. On Linux the worker backs the
//! weights with 2 MiB pages (`MADV_COLLAPSE`), but only whole 2 MiB-aligned
//! regions can be collapsed: a matrix malloc places anywhere keeps up to
//! 2 MiB at each end in 4 KiB pages, and TinyLlama's o_proj (4.4 MB in
//! Q8_0) has more than half of itself there. [`WeightBuf`] starts such
//! arrays on a 2 MiB boundary and pads them to a whole number of 2 MiB
//! pages (at most 2 MiB more per matrix), so all of each can be collapsed.

use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The huge page size arrays of at least this many bytes are aligned to.
const HUGE_PAGE: usize = 2 << 20;

/// Arrays smaller than a huge page: one cache line, for aligned vectors.
const LINE: usize = 64;

/// A fixed-length array of `len` values, 2 MiB-aligned and padded to whole
/// 2 MiB pages on Linux when it spans at least one; cache-line aligned
/// otherwise. The padding holds the fill value too, so every byte of
/// [`WeightBuf::allocation`] is initialised.
pub struct WeightBuf<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Elements allocated (`len` plus the padding).
    capacity: usize,
    /// `None` for an empty array or zero-sized T: nothing allocated.
    layout: Option<Layout>,
}

// SAFETY: WeightBuf owns its elements as a Vec would.
unsafe impl<T: Send> Send for WeightBuf<T> {}
// SAFETY: shared access only hands out `&[T]`.
unsafe impl<T: Sync> Sync for WeightBuf<T> {}

impl<T: Copy> WeightBuf<T> {
    /// `len` copies of `value`.
    pub fn filled(value: T, len: usize) -> Self {
        let bytes = len.checked_mul(size_of::<T>()).expect("weight array size overflows usize");
        if bytes == 0 {
            return Self { ptr: NonNull::dangling(), len, capacity: len, layout: None };
        }
        let huge = cfg!(target_os = "linux") && bytes >= HUGE_PAGE;
        let (align, size) =
            if huge { (HUGE_PAGE, bytes.next_multiple_of(HUGE_PAGE)) } else { (LINE.max(align_of::<T>()), bytes) };
        // Whole elements only (a T whose size does not divide 2 MiB leaves
        // a few bytes of the last page unused).
        let capacity = size / size_of::<T>();
        let layout = Layout::from_size_align(size, align).expect("weight array layout");
        // SAFETY: size > 0.
        let raw = unsafe { alloc(layout) }.cast::<T>();
        let Some(ptr) = NonNull::new(raw) else { handle_alloc_error(layout) };
        for i in 0..capacity {
            // SAFETY: i < capacity elements fit in the allocation.
            unsafe { ptr.as_ptr().add(i).write(value) };
        }
        Self { ptr, len, capacity, layout: Some(layout) }
    }
}

impl<T> WeightBuf<T> {
    /// All of the allocation, padding included: the range to back with
    /// huge pages.
    pub fn allocation(&self) -> &[T] {
        // SAFETY: `capacity` initialised elements from `ptr`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.capacity) }
    }
}

impl<T> Deref for WeightBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` <= `capacity` initialised elements from `ptr`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for WeightBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for WeightBuf<T> {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `filled` with this layout; only Copy
            // elements are ever stored, so none needs dropping in place.
            unsafe { dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

impl<T: Copy> Clone for WeightBuf<T> {
    fn clone(&self) -> Self {
        let Some(&first) = self.allocation().first() else {
            return Self { ptr: NonNull::dangling(), len: self.len, capacity: self.capacity, layout: None };
        };
        let mut copy = Self::filled(first, self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: PartialEq> PartialEq for WeightBuf<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T> std::fmt::Debug for WeightBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBuf<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_arrays_are_line_aligned_and_exact() {
        let b = WeightBuf::filled(7u16, 1000);
        assert_eq!(b.len(), 1000);
        assert!(b.iter().all(|&x| x == 7));
        assert_eq!(b.as_ptr() as usize % LINE, 0);
        assert_eq!(b.allocation().len(), 1000);
    }

    #[test]
    fn large_arrays_start_and_end_on_huge_pages_on_linux() {
        let len = (5 << 20) / 4 + 3; // a little over 5 MiB of u32
        let mut b = WeightBuf::filled(1u32, len);
        b[len - 1] = 9;
        assert_eq!(b.len(), len);
        assert_eq!(b[len - 1], 9);
        let bytes = size_of_val(b.allocation());
        if cfg!(target_os = "linux") {
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            assert_eq!(bytes, 6 << 20);
        } else {
            assert_eq!(bytes, len * 4);
        }
        assert!(b.allocation()[len..].iter().all(|&x| x == 1), "padding is initialised");
        let c = b.clone();
        assert_eq!(c, b);
        assert_eq!(c.as_ptr() as usize % if cfg!(target_os = "linux") { HUGE_PAGE } else { LINE }, 0);
    }

    #[test]
    fn empty_arrays_allocate_nothing() {
        let b = WeightBuf::filled(0u8, 0);
        assert!(b.is_empty() && b.allocation().is_empty());
        assert_eq!(b.clone(), b);
    }
}
