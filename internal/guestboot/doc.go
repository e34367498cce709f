// Package guestboot is what booting a guest needs from package guest, without what
// building images needs: the boot contract between the engine and the guest agent
// (kernel arguments, the user-mode network), the cache directory, the kernel and
// initramfs that guest.Build recorded, data disks, and the lookup of a root image's
// disk by name. Package guest re-exports it (its names are guest's), and the engine
// imports only this package, so that a program embedding the engine does not link
// image building (go-containerregistry, Debian bootstrapping).
package guestboot
