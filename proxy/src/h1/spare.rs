//! Buffers kept for reuse per thread: read buffers, a few per thread (every worker response is
//! read into a buffer of [`READ_SIZE`] bytes, and allocating one per response took the
//! allocator's slow path for large blocks each time: benches/RESULTS.md, "The gateway's own
//! HTTP/1.1, both sides"), and one of each list every response builds ([`Kept`]: a response
//! head's header lines, a worker response's header offsets).

use bytes::BytesMut;
use std::cell::{Cell, RefCell};
use std::ops::{Deref, DerefMut};
use std::thread::LocalKey;

/// The size of a read buffer, and of each read into it.
pub const READ_SIZE: usize = 16 * 1024;

/// Buffers kept per thread: enough for the responses a thread finishes between two it starts,
/// at most 8 x 16 KiB of memory per thread.
const KEPT: usize = 8;

/// The most bytes a kept list may hold: a larger one (from an unusual head) goes back to the
/// allocator.
const KEPT_BYTES: usize = 4096;

thread_local! {
    static SPARE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static LINES: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
    static SPANS: Cell<Vec<[u32; 4]>> = const { Cell::new(Vec::new()) };
}

/// A list taken from its thread's one spare, which goes back empty, on drop, to the spare of the
/// thread that drops it (a request's task may have moved to another thread meanwhile). Every
/// response builds a few such lists, and an allocation fewer per request is worth a
/// thread-local (benches/RESULTS.md, "Fewer allocations and clock reads per request").
#[derive(Debug)]
pub struct Kept<T: 'static> {
    list: Vec<T>,
    home: &'static LocalKey<Cell<Vec<T>>>,
}

/// A response head's header lines.
pub type HeadLines = Kept<u8>;

/// A parsed head's header offsets (name start and end, value start and end).
pub type HeaderSpans = Kept<[u32; 4]>;

impl HeadLines {
    /// An empty buffer with room for a usual head.
    pub fn take() -> Self {
        Kept::take_from(&LINES, 256)
    }
}

impl HeaderSpans {
    /// An empty list with room for a usual head's headers.
    pub fn take() -> Self {
        Kept::take_from(&SPANS, 16)
    }
}

impl<T: 'static> Kept<T> {
    fn take_from(home: &'static LocalKey<Cell<Vec<T>>>, room: usize) -> Self {
        let mut list = home.with(Cell::take);
        if list.capacity() == 0 {
            list.reserve(room);
        }
        Self { list, home }
    }
}

impl<T> Deref for Kept<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.list
    }
}

impl<T> DerefMut for Kept<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.list
    }
}

impl<T> Drop for Kept<T> {
    fn drop(&mut self) {
        let mut list = std::mem::take(&mut self.list);
        if list.capacity() * std::mem::size_of::<T>() <= KEPT_BYTES {
            list.clear();
            // Not kept when the thread's locals are already gone (a drop at thread exit).
            let _ = self.home.try_with(|h| h.set(list));
        }
    }
}

/// A read buffer that, dropped when nothing else shares its memory any more, goes back to the
/// spares of the thread that drops it instead of the allocator.
#[derive(Debug)]
pub struct ReadBuffer(BytesMut);

impl ReadBuffer {
    /// An empty buffer with room for a read: a spare one when the thread has one.
    pub fn take() -> Self {
        Self(SPARE.with(|s| s.borrow_mut().pop()).unwrap_or_else(|| BytesMut::with_capacity(READ_SIZE)))
    }
}

impl Deref for ReadBuffer {
    type Target = BytesMut;
    fn deref(&self) -> &BytesMut {
        &self.0
    }
}

impl DerefMut for ReadBuffer {
    fn deref_mut(&mut self) -> &mut BytesMut {
        &mut self.0
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.0);
        buf.clear();
        // Only a buffer whose memory no `Bytes` split from it still holds, and as large as a
        // fresh one, is kept; others go back to the allocator as before.
        if buf.try_reclaim(READ_SIZE) {
            // Not kept when the thread's locals are already gone (a drop at thread exit).
            let _ = SPARE.try_with(|s| {
                let mut s = s.borrow_mut();
                if s.len() < KEPT {
                    s.push(buf);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_only_when_nothing_shares_it() {
        let mut a = ReadBuffer::take();
        a.extend_from_slice(b"head");
        let ptr = a.as_ptr();
        let held = a.split_to(2).freeze();
        drop(a);
        // Still shared by `held`: not kept, so the next one is another allocation.
        let b = ReadBuffer::take();
        assert_ne!(b.as_ptr(), ptr);
        assert_eq!(&held[..], b"he");
        drop(held);
        let mut c = ReadBuffer::take();
        c.extend_from_slice(b"xy");
        let ptr = c.as_ptr();
        drop(c);
        let d = ReadBuffer::take();
        assert_eq!(d.as_ptr(), ptr, "an unshared buffer is reused");
        assert!(d.is_empty() && d.capacity() >= READ_SIZE);
    }

    #[test]
    fn head_lines_come_back_empty_unless_too_large() {
        let mut a = HeadLines::take();
        a.extend_from_slice(b"x-a: 1\r\n");
        let ptr = a.as_ptr();
        drop(a);
        let b = HeadLines::take();
        assert_eq!((b.as_ptr(), b.len()), (ptr, 0), "reused, and empty");
        let mut big = b;
        big.reserve(2 * KEPT_BYTES);
        drop(big);
        assert!(HeadLines::take().capacity() < KEPT_BYTES, "a large one is not kept");
        let mut spans = HeaderSpans::take();
        spans.push([1, 2, 3, 4]);
        let ptr = spans.as_ptr();
        drop(spans);
        let again = HeaderSpans::take();
        assert_eq!((again.as_ptr(), again.len()), (ptr, 0), "each kind has its own spare");
    }

    #[test]
    fn at_most_a_few_are_kept() {
        let all: Vec<ReadBuffer> = (0..KEPT + 4).map(|_| ReadBuffer::take()).collect();
        drop(all);
        assert_eq!(SPARE.with(|s| s.borrow().len()), KEPT);
    }
}
