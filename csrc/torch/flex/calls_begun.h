// How many flex collectives (a ring call's handshake, an all-gather) this
// thread has begun: the module wrapper (cplib/flex/hook.py) reads it around
// a forward to tell an error raised before this rank joined any collective,
// which it hands to the other ranks' pending handshake, from one raised
// after, which it must not (no rank would be waiting for it).
#pragma once

#include <cstdint>

namespace cplib::flex {

void note_call_begun();

}  // namespace cplib::flex
