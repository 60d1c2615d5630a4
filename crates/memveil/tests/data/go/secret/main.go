// A Go program that holds a secret it no longer uses while it works, as
// tests/data/static_secret.c does for C: reads "SECRET MARKER" from stdin
// with one read(2) straight into a 64 KiB slice (no other copy of the
// secret: fmt's and bufio's buffers would leave one in objects the program
// keeps using), keeps SECRET in a page of its own in the middle of it,
// fills 32 MiB of other data, then rewrites MARKER into a 1 MiB working
// buffer over and over (goroutines and garbage meanwhile). Prints
// "ready PID" once all is written, then works until SIGTERM.
package main

import (
	"bytes"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"
	"unsafe"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)
	arena := make([]byte, 64<<10)
	off := 32<<10 - int(uintptr(unsafe.Pointer(&arena[0]))&4095)
	page := arena[off : off+4096]
	got := 0
	for got < 511 {
		n, err := syscall.Read(0, page[got:511])
		if n <= 0 || err != nil {
			break
		}
		got += n
		if bytes.IndexByte(page[:got], '\n') >= 0 {
			break
		}
	}
	line := bytes.TrimRight(page[:got], "\r\n")
	sp := bytes.IndexByte(line, ' ')
	if sp < 0 {
		os.Exit(2)
	}
	marker := append([]byte(nil), line[sp+1:]...)
	for i := sp; i < got; i++ {
		page[i] = 0
	}
	heap := make([][]byte, 32)
	for i := range heap {
		heap[i] = make([]byte, 1<<20)
		for j := range heap[i] {
			heap[i][j] = 0x5a
		}
	}
	work := make([]byte, 1<<20)
	copy(work, marker)
	fmt.Printf("ready %d\n", os.Getpid())
	var sum int
	for {
		select {
		case <-stop:
			fmt.Println("done", sum&0, len(arena), len(heap))
			// The secret's page stays allocated to the end: were the arena
			// collected, its pages would be reused (touched, so faulted back
			// with the secret in them) for the loop's garbage.
			runtime.KeepAlive(arena)
			return
		default:
		}
		done := make(chan int, 4)
		for g := 0; g < 4; g++ {
			go func(g int) {
				b := make([]byte, 64<<10)
				b[g] = byte(g)
				done <- int(b[g])
			}(g)
		}
		for g := 0; g < 4; g++ {
			sum += <-done
		}
		for i := 0; i < len(work); i += 4096 {
			work[i]++
		}
		copy(work, marker)
		time.Sleep(time.Millisecond)
	}
}
