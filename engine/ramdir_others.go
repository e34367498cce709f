//go:build !linux

package engine

// checkRAMDirPages: transparent huge pages in tmpfs are a Linux matter.
func checkRAMDirPages(string) error { return nil }
