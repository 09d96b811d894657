//! Read buffers kept for reuse, a few per thread: every worker response is read into a buffer
//! of [`READ_SIZE`] bytes, and allocating one per response took the allocator's slow path for
//! large blocks each time (benches/RESULTS.md, "The gateway's own HTTP/1.1, both sides").

use bytes::BytesMut;
use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// The size of a read buffer, and of each read into it.
pub const READ_SIZE: usize = 16 * 1024;

/// Buffers kept per thread: enough for the responses a thread finishes between two it starts,
/// at most 8 x 16 KiB of memory per thread.
const KEPT: usize = 8;

thread_local! {
    static SPARE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
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
    fn at_most_a_few_are_kept() {
        let all: Vec<ReadBuffer> = (0..KEPT + 4).map(|_| ReadBuffer::take()).collect();
        drop(all);
        assert_eq!(SPARE.with(|s| s.borrow().len()), KEPT);
    }
}
