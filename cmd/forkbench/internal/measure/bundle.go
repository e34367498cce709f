package measure

import (
	"bytes"
	"os"

	"github.com/forkvm/forkvm/tracebundle"
)

// WriteBundle writes the --trace bundle of the run of bench measured at measuredAt: the
// spans and counter tracks of t (Chrome JSON), the kernel trace ktext and --perf's perf
// Script text perfScript (nil: none), all on CLOCK_MONOTONIC, with the manifest that
// makes Perfetto open them as one trace.
func WriteBundle(path string, t *Trace, ktext, perfScript []byte, bench, measuredAt string) error {
	var spans bytes.Buffer
	if _, err := t.WriteTo(&spans); err != nil {
		return err
	}
	files := []tracebundle.File{{Name: "forkvm-spans.json", Kind: tracebundle.ChromeJSON, Data: spans.Bytes()}}
	if len(ktext) > 0 {
		files = append(files, tracebundle.File{Name: "ftrace.txt", Kind: tracebundle.Ftrace, Data: ktext})
	}
	if len(perfScript) > 0 {
		files = append(files, tracebundle.File{Name: PerfScriptFile, Kind: tracebundle.PerfScript, Data: perfScript})
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = tracebundle.Write(f, files, map[string]string{"forkvm.bench": bench, "forkvm.measured_at": measuredAt})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
	}
	return err
}
