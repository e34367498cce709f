//go:build !linux

// Command forkvm-agent is the forkvm guest agent; it only runs on Linux.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "forkvm-agent: only supported on linux")
	os.Exit(1)
}
