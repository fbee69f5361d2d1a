#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <string.h>
int main(){ size_t n=64<<20; for(int r=0;r<5;r++){ struct timespec a,b; clock_gettime(CLOCK_MONOTONIC,&a);
 char*p=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); for(size_t i=0;i<n;i+=4096)p[i]=1; munmap(p,n);
 clock_gettime(CLOCK_MONOTONIC,&b); printf("%.2f ms\n",(b.tv_sec-a.tv_sec)*1e3+(b.tv_nsec-a.tv_nsec)/1e6);} }
