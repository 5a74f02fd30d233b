// Command etcd is etcd's server main (go.etcd.io/etcd/server/v3), the
// storage the API server needs.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
