//! Buffers kept for reuse per thread: read buffers, a few per thread (every worker response is
//! read into a buffer of [`READ_SIZE`] bytes, and allocating one per response took the
//! allocator's slow path for large blocks each time: benches/RESULTS.md, "The gateway's own
//! HTTP/1.1, both sides"), and one buffer for a response head's header lines ([`HeadLines`]).

use bytes::BytesMut;
use std::cell::{Cell, RefCell};
use std::ops::{Deref, DerefMut};

/// The size of a read buffer, and of each read into it.
pub const READ_SIZE: usize = 16 * 1024;

/// Buffers kept per thread: enough for the responses a thread finishes between two it starts,
/// at most 8 x 16 KiB of memory per thread.
const KEPT: usize = 8;

/// The most a kept head-lines buffer may hold: larger ones (a worker's unusual head) go back to
/// the allocator.
const LINES_KEPT_CAPACITY: usize = 4096;

thread_local! {
    static SPARE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static LINES: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

/// A response head's header lines: a buffer taken from its thread's spare, which goes back there
/// on drop. Every response builds one, and one allocation fewer per request is worth a
/// thread-local (benches/RESULTS.md, "Fewer allocations and clock reads per request").
#[derive(Debug)]
pub struct HeadLines(Vec<u8>);

impl HeadLines {
    /// An empty buffer with room for a usual head.
    pub fn take() -> Self {
        let mut v = LINES.with(Cell::take);
        if v.capacity() == 0 {
            v.reserve(256);
        }
        Self(v)
    }
}

impl Deref for HeadLines {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl DerefMut for HeadLines {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

impl Drop for HeadLines {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        if v.capacity() <= LINES_KEPT_CAPACITY {
            v.clear();
            LINES.with(|l| l.set(v));
        }
    }
}

/// A read buffer that, dropped when nothing else shares its memory any more, goes back to its
/// thread's spares instead of the allocator.
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
            SPARE.with(|s| {
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
        big.reserve(2 * LINES_KEPT_CAPACITY);
        drop(big);
        assert!(HeadLines::take().capacity() < LINES_KEPT_CAPACITY, "a large one is not kept");
    }

    #[test]
    fn at_most_a_few_are_kept() {
        let all: Vec<ReadBuffer> = (0..KEPT + 4).map(|_| ReadBuffer::take()).collect();
        drop(all);
        assert_eq!(SPARE.with(|s| s.borrow().len()), KEPT);
    }
}
