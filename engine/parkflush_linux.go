package engine

import (
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// parkWritebackEvery is how often startWriteback asks the kernel to write out what
// the extraction wrote so far.
const parkWritebackEvery = 5 * time.Millisecond

// startWriteback starts writing path's dirty pages to disk while they are being
// written (the page extraction), without waiting for them (sync_file_range
// SYNC_FILE_RANGE_WRITE), so that the flush after the park's commit finds most of them
// written already: the disk works while the extraction copies. stop ends it and
// returns once it has.
func startWriteback(path string) (stop func()) {
	done, ended := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(ended)
		var f *os.File
		defer func() {
			if f != nil {
				f.Close()
			}
		}()
		t := time.NewTicker(parkWritebackEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			if f == nil {
				var err error
				if f, err = os.Open(path); err != nil {
					continue // not created yet
				}
			}
			_ = unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
		}
	}()
	return func() {
		close(done)
		<-ended
	}
}
