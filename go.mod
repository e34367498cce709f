module github.com/forkvm/forkvm

go 1.26.0

require (
	github.com/containerd/console v1.0.5
	github.com/creack/pty v1.1.24
	github.com/mdlayher/vsock v1.4.0
	github.com/ulikunitz/xz v0.5.17
	github.com/urfave/cli/v3 v3.14.0
	golang.org/x/sync v0.24.0
	golang.org/x/sys v0.50.0
)

require (
	github.com/mdlayher/socket v0.8.0 // indirect
	golang.org/x/net v0.62.0 // indirect
)
