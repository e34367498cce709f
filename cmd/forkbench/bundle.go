package main

import (
	"bytes"
	"os"

	"github.com/forkvm/forkvm/tracebundle"
)

// writeBundle writes the --trace bundle: the spans and counter tracks (Chrome JSON),
// the kernel trace ktext (nil: none) and --perf's perf script text, all on
// CLOCK_MONOTONIC, with the manifest that makes Perfetto open them as one trace.
func (r *runner) writeBundle(path string, ktext []byte) error {
	var spans bytes.Buffer
	if _, err := r.trace.WriteTo(&spans); err != nil {
		return err
	}
	files := []tracebundle.File{{Name: "forkvm-spans.json", Kind: tracebundle.ChromeJSON, Data: spans.Bytes()}}
	if len(ktext) > 0 {
		files = append(files, tracebundle.File{Name: "ftrace.txt", Kind: tracebundle.Ftrace, Data: ktext})
	}
	if b := r.files[perfScriptFile]; len(b) > 0 {
		files = append(files, tracebundle.File{Name: perfScriptFile, Kind: tracebundle.PerfScript, Data: b})
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = tracebundle.Write(f, files, map[string]string{"forkvm.bench": r.bench, "forkvm.measured_at": r.res.MeasuredAt})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
	}
	return err
}
