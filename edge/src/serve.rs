//! The client-facing HTTP server.

pub fn main(_args: &[String]) -> i32 {
    todo!("serve")
}
