// Package platform holds the engine's few calls that differ by operating system, each
// behind one function, so that the engine's own files carry no build tags: which
// accelerator the host offers (DetectAccel), the two clocks a phase is stamped with
// (ClockStamp), a thread that yields the CPU to forks (BackgroundThread), a guest's
// threads that go first for the length of its pause (Boost, Unboost), a helper
// process that dies with the engine (BoundOutput), and the RAM directory's page-size
// check (CheckRAMDirPages). Every function works on every OS the engine builds for; where
// a facility is Linux's alone the others do the nearest safe thing, as their comments say.
package platform
