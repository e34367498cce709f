//go:build linux

package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"github.com/forkvm/forkvm/vsockd"
)

const (
	modulesList              = "/etc/forkvm/modules"
	defaultPath              = "/bin:/sbin:/usr/bin:/usr/sbin"
	moduleInitCompressedFile = 4 // MODULE_INIT_COMPRESSED_FILE
)

// runInit is the PID 1 entry point. It never returns: if PID 1 exits the
// kernel panics. switched is set in the agent of a root image, executed by
// the initramfs's agent after switching root (see root_linux.go).
func runInit(switched bool) {
	mountBasics()
	console := openConsole()
	logger := log.New(console, "forkvm-agent: ", 0)
	surviveSignals(logger)
	os.Setenv("PATH", defaultPath)
	os.Setenv("HOME", "/root")
	args := readBootArgs(logger)
	if switched {
		os.Setenv("PATH", imagePath)
		prepareImage(logger)
	} else {
		loadModules(logger, modulesList)
		if args.net {
			loadModules(logger, netModules)
		}
		if args.root != nil {
			enterImage(logger, *args.root) // does not return
		}
	}
	if args.net {
		// In a root image: after switch_root, so the files land in the image's /etc.
		setUpNet(logger)
	}
	if args.data != nil {
		mountData(logger, *args.data)
	}
	srv := &vsockd.Server{Log: logger}
	srv.ExecCgroup, srv.ExecPidsMax = setUpExecCgroup(logger)
	srv.PrepareExec()

	ready := make(chan string, 1)
	if _, err := os.Stat("/dev/vsock"); err == nil {
		go serveVsock(srv, logger)
	}
	go serveVirtioPort(srv, logger, ready)
	// Ready is the virtio-serial port's, the transport forkvm's host side uses (the
	// vsock listener, for hosts that add a vsock device, only logs that it listens).
	fmt.Fprintf(console, "forkvm-agent: ready (%s)\n", <-ready)
	select {} // PID 1 must never exit; the reaper runs in vsockd
}

// mountBasics mounts the pseudo file systems that are not mounted yet (in a
// root image, /dev, /proc, /sys and /run come mounted from the initramfs);
// errors are reported on stderr and otherwise ignored.
func mountBasics() {
	type m struct{ src, dst, fstype, data string }
	mounts := []m{
		{"proc", "/proc", "proc", ""},
		{"sysfs", "/sys", "sysfs", ""},
		{"devtmpfs", "/dev", "devtmpfs", "mode=0755"},
		{"devpts", "/dev/pts", "devpts", "mode=0620,ptmxmode=0666"},
		{"tmpfs", "/dev/shm", "tmpfs", "mode=1777"},
		{"tmpfs", "/tmp", "tmpfs", "mode=1777"},
		{"tmpfs", "/run", "tmpfs", "mode=0755"},
	}
	for _, x := range mounts {
		if isMountpoint(x.dst) {
			continue
		}
		os.MkdirAll(x.dst, 0o755)
		err := unix.Mount(x.src, x.dst, x.fstype, unix.MS_NOSUID, x.data)
		if err != nil && err != unix.EBUSY {
			fmt.Fprintf(os.Stderr, "forkvm-agent: mount %s: %v\n", x.dst, err)
		}
	}
	if _, err := os.Lstat("/dev/ptmx"); err != nil {
		os.Symlink("pts/ptmx", "/dev/ptmx")
	}
}

func openConsole() io.Writer {
	f, err := os.OpenFile("/dev/console", os.O_WRONLY|unix.O_NOCTTY, 0)
	if err != nil {
		return os.Stderr
	}
	return f
}

// loadModules loads the modules listed (absolute paths, dependency order)
// in list with finit_module. Failures are logged and skipped.
func loadModules(logger *log.Logger, list string) {
	f, err := os.Open(list)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			logger.Printf("modules: %v", err)
		}
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		path := strings.TrimSpace(sc.Text())
		if path == "" || strings.HasPrefix(path, "#") {
			continue
		}
		if err := loadModule(path); err != nil {
			logger.Printf("load module %s: %v", path, err)
		}
	}
}

func loadModule(path string) error {
	m, err := os.Open(path)
	if err != nil {
		return err
	}
	defer m.Close()
	flags := 0
	if strings.HasSuffix(path, ".xz") || strings.HasSuffix(path, ".zst") {
		flags = moduleInitCompressedFile
	}
	err = unix.FinitModule(int(m.Fd()), "", flags)
	if err == unix.EEXIST {
		return nil
	}
	return err
}

// serveVsock serves each AF_VSOCK connection as its own session.
func serveVsock(srv *vsockd.Server, logger *log.Logger) {
	ln, err := vsock.Listen(vsockd.DefaultVsockPort, nil)
	if err != nil {
		logger.Printf("vsock: %v", err)
		return
	}
	logger.Printf("listening on AF_VSOCK port %d", vsockd.DefaultVsockPort)
	for {
		conn, err := ln.Accept()
		if err != nil {
			logger.Printf("vsock accept: %v", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		go func() {
			if err := srv.ServeConn(context.Background(), conn); err != nil {
				logger.Printf("vsock session: %v", err)
			}
		}()
	}
}

// findPort returns the /dev node of the virtio-serial port called name.
func findPort(name string) (string, bool) {
	dirs, _ := filepath.Glob("/sys/class/virtio-ports/*")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "name"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			return "/dev/" + filepath.Base(d), true
		}
	}
	return "", false
}
