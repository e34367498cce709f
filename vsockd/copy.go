package vsockd

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/forkvm/forkvm/tarstream"
)

// The guest side of copies (FeatureCopy): CopyIn extracts a tar stream into a guest
// directory, CopyOut streams a tar of a guest path, Stat answers a path's attributes.
// Both copies run on their stream's goroutine, within the stream's flow-control credit,
// and end with FileEnd or an Error frame.

// copyErrCode maps a copy failure onto an Error frame code.
func copyErrCode(err error) string {
	switch {
	case errors.Is(err, ErrUnsafeEntry):
		return CodeUnsafe
	case errors.Is(err, ErrNotDirectory):
		return CodeNotDir
	case errors.Is(err, ErrSourceMissing):
		return CodeNoSource
	case errors.Is(err, ErrBadArchive):
		return CodeBadArchive
	}
	return errCode(err)
}

// startCopyIn extracts the stream's tar data into an existing directory.
func (ss *session) startCopyIn(f Frame) {
	gen := ss.curGen()
	var req copyInWire
	if err := json.Unmarshal(f.Payload, &req); err != nil || !filepath.IsAbs(req.Dir) {
		ss.sendError(gen, f.Stream, CodeBadRequest, "copy in: bad request (directory must be absolute)")
		return
	}
	st := ss.addStream(f.Stream, nil)
	if st == nil {
		ss.sendError(gen, f.Stream, CodeBadRequest, "copy in: stream id in use")
		return
	}
	go func() {
		r := &streamReader{ss: ss, st: st}
		// Into the guest: the host's links, absolute ones too, are the guest's to keep.
		err := tarstream.ExtractTar(st.ctx, r, req.Dir, &tarstream.ExtractOptions{Links: tarstream.LinksKeep})
		if err == nil && !r.ended {
			err = fmt.Errorf("%w: data after the end of the archive", ErrProtocol)
		}
		if st.ctx.Err() != nil {
			return // reset by the host, or the session ended
		}
		if err != nil {
			ss.srv.logf("vsockd: copy into %s: %v", req.Dir, err)
			ss.drop(st)
			ss.sendError(st.gen, st.id, copyErrCode(err), err.Error())
			return
		}
		ss.send(st.gen, Frame{Type: TypeFileEnd, Stream: st.id})
		ss.drop(st)
	}()
}

// startCopyOut streams a tar of a guest path.
func (ss *session) startCopyOut(f Frame) {
	gen := ss.curGen()
	var req copyOutWire
	if err := json.Unmarshal(f.Payload, &req); err != nil || !filepath.IsAbs(req.Path) {
		ss.sendError(gen, f.Stream, CodeBadRequest, "copy out: bad request (path must be absolute)")
		return
	}
	st := ss.addStream(f.Stream, nil)
	if st == nil {
		ss.sendError(gen, f.Stream, CodeBadRequest, "copy out: stream id in use")
		return
	}
	go func() {
		// Buffer to whole frames: tar writes 512-byte headers one at a time.
		bw := bufio.NewWriterSize(&streamWriter{ss: ss, st: st}, chunkSize)
		err := tarstream.WriteTar(st.ctx, bw, req.Path, "")
		if err == nil {
			err = bw.Flush()
		}
		if st.ctx.Err() != nil {
			return
		}
		if err != nil {
			ss.drop(st)
			ss.sendError(st.gen, st.id, copyErrCode(err), err.Error())
			return
		}
		ss.send(st.gen, Frame{Type: TypeFileEnd, Stream: st.id})
		ss.drop(st)
	}()
}

// stat answers a Stat request.
func (ss *session) stat(f Frame) {
	gen := ss.curGen()
	var req statWire
	if err := json.Unmarshal(f.Payload, &req); err != nil || !filepath.IsAbs(req.Path) {
		ss.sendError(gen, f.Stream, CodeBadRequest, "stat: bad request (path must be absolute)")
		return
	}
	go func() {
		fi, err := os.Stat(req.Path)
		if err != nil {
			ss.sendError(gen, f.Stream, errCode(err), err.Error())
			return
		}
		ss.sendJSON(gen, TypeStatReply, f.Stream, statReplyWire{
			Name: fi.Name(), Size: fi.Size(), Mode: uint32(fi.Mode()), MtimeNs: fi.ModTime().UnixNano(),
		})
	}()
}

// streamReader reads a stream's FileData frames up to its FileEnd (then io.EOF),
// returning credit to the host as the data is consumed.
type streamReader struct {
	ss    *session
	st    *gstream
	buf   []byte
	held  int // bytes of the current frame not yet credited back
	ended bool
}

func (r *streamReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		if r.held > 0 {
			r.st.in.release(r.held)
			r.ss.send(r.st.gen, windowFrame(r.st.id, r.held))
			r.held = 0
		}
		if r.ended {
			return 0, io.EOF
		}
		f, err := r.st.in.pop(r.st.ctx)
		if err != nil {
			return 0, err
		}
		switch f.Type {
		case TypeFileData:
			r.buf, r.held = f.Payload, len(f.Payload)
		case TypeFileEnd:
			r.ended = true
		}
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// streamWriter sends what is written as FileData frames within the stream's credit.
type streamWriter struct {
	ss *session
	st *gstream
}

func (w *streamWriter) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		k, err := w.st.win.acquire(w.st.ctx, min(len(p)-done, chunkSize))
		if err != nil {
			return done, err
		}
		if err := w.ss.send(w.st.gen, Frame{Type: TypeFileData, Stream: w.st.id, Payload: p[done : done+k]}); err != nil {
			return done, err
		}
		done += k
	}
	return done, nil
}
